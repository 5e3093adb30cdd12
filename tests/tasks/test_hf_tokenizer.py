"""The chat-template sandbox (jaxrl_llm.tasks.hf_tokenizer.compile_chat_template): the
strings a template builds are bounded as jinja bounds ``range``; ordinary templates
render as before."""

from __future__ import annotations

import pytest

pytest.importorskip("jinja2")

from jinja2.exceptions import SecurityError

from jaxrl_llm.tasks.hf_tokenizer import MAX_TEMPLATE_SIZE, compile_chat_template

_LOOP = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}"


@pytest.mark.parametrize("source, says", [
    ("{{ ('x' * 10**8)|length }}", "repeats a str of 1 items 100000000 times"),
    ("{{ (10 * ['x'] * 10**7)|length }}", "repeats a list of 10 items 10000000 times"),
    ("{{ 10**(10**8) }}", "raises 10 to the power 100000000"),
    (_LOOP.replace("OP", "~") + "{% endfor %}", "concatenates (~) a string too long"),
    (_LOOP.replace("OP", "+") + "{% endfor %}", "concatenates a string too long"),
    ("{{ 'x'|center(10**8) }}", "passes 100000000 as an argument"),
    ("{{ 'x'.ljust(10**8) }}", "passes 100000000 as an argument"),
    ("{{ '{:>100000000}'.format(1) }}", "passes 100000000 as an argument"),
    ("{{ '{0:>5.100000000f}'.format(1.0) }}", "passes 100000000 as an argument"),
    ("{{ '%100000000d' % 1 }}", "passes 100000000 as an argument"),
    ("{{ '%.100000000f'|format(1.0) }}", "passes 100000000 as an argument"),
    ("{{ ('x' * 10**4).replace('x', 'y' * 10**4) }}", "replaces into a string too long"),
    ("{{ ('x' * 10**4)|replace('x', 'y' * 10**4) }}", "replaces into a string too long"),
])
def test_a_template_cannot_build_an_unbounded_string(source, says):
  """Reliability issue, item 9: ``{{ ('x' * 10**8)|length }}`` rendered (100 MB, and
  ``10**8`` is no limit); every way to build a string is bounded by
  MAX_TEMPLATE_SIZE, refused before the allocation where its size is known."""
  with pytest.raises(SecurityError) as info:
    compile_chat_template(source).render()
  assert says in str(info.value) and f"{MAX_TEMPLATE_SIZE} characters" in str(info.value)


def test_ordinary_templates_render_as_before():
  source = ("{{ '%5s'|format(3) }}|{{ '{:>5}|{}'.format(3, 4) }}|{{ '%5d' % 7 }}|"
            "{{ 'ab' * 3 }}|{{ 3 * 'x' }}|{{ 'a' ~ 1 ~ 'b' }}|{{ [1, 2] + [3] }}|"
            "{{ 2**10 }}|{{ 'a,b'.split(',')|join('-') }}|{{ 'hello'.replace('l', 'L') }}|"
            "{{ 'x'|center(7) }}|{{ 100 % 7 }}|{{ 'x' * -1 }}|{{ messages[0]['content'] }}")
  text = compile_chat_template(source).render(messages=[{"content": "y" * 100_000}])
  assert text == ("    3|    3|4|    7|ababab|xxx|a1b|[1, 2, 3]|1024|a-b|heLLo|   x   |2|"
                  "|" + "y" * 100_000)
  assert len(compile_chat_template("{{ 'x' * n }}").render(n=MAX_TEMPLATE_SIZE)) == (
      MAX_TEMPLATE_SIZE)
