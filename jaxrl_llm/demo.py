"""A toy batch through the functional core: GAE, GRPO advantages and a PPO loss.

Run with ``python -m jaxrl_llm.demo``.
"""

import jax.numpy as jnp
import numpy as np

import jaxrl_llm as rl


def main():
  rng = np.random.default_rng(0)
  batch, time, group = 4, 6, 2
  mask = np.ones((batch, time), np.float32)
  mask[1, 4:] = 0
  mask[3, 2:] = 0
  scores = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
  lengths = mask.sum(1).astype(int)
  rewards = np.zeros((batch, time), np.float32)
  rewards[np.arange(batch), lengths - 1] = scores
  values = rng.normal(0.5, 0.1, (batch, time)).astype(np.float32)

  adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)
  print("GAE advantages (scan):\n", np.round(np.asarray(adv), 3))
  adv_par, _ = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95, method="associative")
  print("scan == associative:", bool(jnp.allclose(adv, adv_par, atol=1e-6)))
  print("GRPO advantages:", np.round(np.asarray(rl.grpo_advantages(scores, group_size=group)), 4))
  print("RLOO advantages:", np.round(np.asarray(rl.rloo_advantages(scores, group_size=group)), 4))
  if hasattr(rl, "ppo_policy_loss"):
    logp = rng.normal(-1.0, 0.1, (batch, time)).astype(np.float32)
    old_logp = logp + rng.normal(0, 0.2, (batch, time)).astype(np.float32)
    per_token, metrics = rl.ppo_policy_loss(logp, old_logp, rl.masked_whiten(adv, mask),
                                            mask, clip_low=0.2)
    print("PPO loss (token-mean):", float(rl.aggregate(per_token, mask, "token-mean")))
    print("metrics:", {k: round(float(v), 4) for k, v in metrics.items()})


if __name__ == "__main__":
  main()
