"""Writes ``arithmetic.jsonl``: two-digit additions asked in plain English, the dataset
the README's real-model command trains SmolLM2-135M-Instruct on (seeded: the file in
the repository is this script's output).

    python examples/data/make_arithmetic.py
"""

import json
import os

import numpy as np


def main(rows: int = 400, seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(rows):
      a, b = (int(x) for x in rng.integers(10, 100, size=2))
      f.write(json.dumps({"prompt": f"What is {a} + {b}? Answer with the number only.",
                          "answer": a + b}) + "\n")


if __name__ == "__main__":
  main()
