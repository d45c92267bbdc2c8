"""Chat templates from untrusted checkpoints render within a budget of time, loop iterations and text: a hostile
template is refused with a ChatTemplateError (a DeltaserveError, which the server answers with 400) in bounded
time and memory, while real templates render as before."""

import resource
import time

import pytest

from deltaserve.convert import train_tokenizer
from deltaserve.errors import ChatTemplateError, DeltaserveError
from deltaserve import chat_template
from deltaserve.tokenizer import CHATML_TEMPLATE

MESSAGES = [{"role": "user", "content": "hi"}]

BOMBS = {
    "string-times": "{{ 'a' * 10**9 }}",
    "list-times": "{{ ([1] * 10**9)|length }}",
    "nested-range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "range-1e6": "{% for i in range(10**6) %}{{ i }}{% endfor %}",
    "nested-messages": "{% for a in messages * 1000 %}{% for b in messages * 1000 %}{% for c in messages * 1000 %}"
                       "{% endfor %}{% endfor %}{% endfor %}",
    "center": "{{ 'a'.center(10**9) }}",
    "center-filter": "{{ 'a'|center(1000000000) }}",
    "format-width": "{{ '{:>1000000000}'.format(1) }}",
    "format-argument": "{{ '{:>{}}'.format(1, 10**9) }}",
    "format-map": "{{ '{a:>{w}}'.format_map({'a': 1, 'w': 10**9}) }}",
    "percent-width": "{{ '%1000000000d' % 1 }}",
    "percent-star": "{{ '%*d' % (10**9, 1) }}",
    "format-filter": "{{ '%1000000000d'|format(1) }}",
    "replace-empty": "{{ ('a' * 100000).replace('', 'b' * 100000) }}",
    "replace-filter": "{{ ('a' * 100000)|replace('', 'b' * 100000) }}",
    "join-long-separator": "{{ ('a' * 1000000)|join('b' * 1000000) }}",
    "namespace-doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s|length }}",
    "plus-doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "macro-doubling": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
                      "{% endmacro %}{{ d('a', 40) }}",
    "macro-exponential": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "macro-recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "captured-block": "{% set x %}{% for i in range(10**6) %}{{ 'y' * 100000 }}{% endfor %}{% endset %}",
    "captured-literal": "{% set x %}{% for i in range(10**6) %}" + "z" * 10000 + "{% endfor %}{% endset %}",
    "indent-width": "{{ ('a\n' * 100000)|indent(100000) }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(100000) }}",
    "batch-fill": "{{ [1]|batch(1000000000, 'x')|list|length }}",
    "tojson-indent": "{{ messages|tojson(indent=1000000000) }}",
    "sum-of-lists": "{{ ([[1]] * 100000)|sum(start=[])|length }}",
    "translate": "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
    "huge-power": "{{ 7 ** 100000 }}",
    "huge-product": "{{ (10**4000) * (10**4000) }}",
    "recursive-loop": "{% for x in [range(10**8)] recursive %}{{ loop(x) if x is iterable else '' }}{% endfor %}",
    "sort-big-list": "{{ ('a' * 2000000)|list|sort|length }}",
    "select-endless": "{{ range(10**9)|select('odd')|list|length }}",
    "lipsum": "{{ lipsum(10**6) }}",
    "zero-division": "{{ 1 // 0 }}",
    "python-internals": "{{ ''.__class__.__mro__ }}",
}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture
def quick(monkeypatch):
    """A 0.5 s deadline, so that the tests that run into it are quick."""
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)


@pytest.mark.parametrize("source", BOMBS.values(), ids=BOMBS.keys())
def test_hostile_templates_are_refused_in_bounded_time_and_memory(tok, quick, source):
    tok.chat_template = source
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    with pytest.raises(ChatTemplateError, match="chat template"):
        tok.apply_chat_template(MESSAGES)
    assert time.monotonic() - start < 3
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB


def test_the_error_is_one_the_server_answers_with_400(tok):
    assert issubclass(ChatTemplateError, DeltaserveError)
    tok.chat_template = "{{ 'a' * 10**9 }}"
    with pytest.raises(DeltaserveError, match=r"would build a repeated sequence of 1000000000 characters \(limit"):
        tok.apply_chat_template(MESSAGES)


def test_big_ranges_are_not_an_overflow_error(tok):
    """jinja's own range() raised OverflowError past 100000 items: a 500, not a 400."""
    tok.chat_template = "{% for i in range(10**6) %}{% endfor %}{{ range(10**9)|length }} {{ range(10**9)[-1] }}"
    assert tok.apply_chat_template(MESSAGES) == "1000000000 999999999"
    tok.chat_template = "{% for i in range(10**6 + 1) %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="more than 1000000 loop iterations"):
        tok.apply_chat_template(MESSAGES)


def test_the_budget_is_per_render(tok):
    tok.chat_template = "{% for i in range(600000) %}{% endfor %}{{ messages[0].content }}"
    assert [tok.apply_chat_template(MESSAGES) for _ in range(3)] == ["hi"] * 3


def test_text_handed_in_widens_the_budget(tok):
    """The output of a template is a few times its input: a long conversation renders."""
    tok.chat_template = CHATML_TEMPLATE
    long = [{"role": "user", "content": "x" * (3 * chat_template.MAX_CHARS)}]
    assert len(tok.apply_chat_template(long)) == 3 * chat_template.MAX_CHARS + len("<|im_start|>user\n<|im_end|>\n"
                                                                                  "<|im_start|>assistant\n")


def test_real_template_constructs_still_render(tok):
    tok.chat_template = (
        "{% set ns = namespace(n=0, text='') %}"
        "{% macro tag(role) %}<{{ role }}>{% endmacro %}"
        "{% for m in messages * 3 %}{% set ns.n = ns.n + 1 %}{{ tag(m.role) }}{{ m.content|upper }}"
        "{% if not loop.last %}, {% endif %}{% endfor %}"
        "{% set block %}{% for i in range(3) %}{{ i }}{% endfor %}{% endset %}"
        " {{ ns.n }} {{ block }} {{ '%5s|' % 'ab' }}{{ '{:>4}'.format(7) }} {{ ['a', 'b']|join('-') }}"
        " {{ 'x'.center(5) }}| {{ messages|tojson }} {{ 2 ** 10 }} {{ range(3)|map('string')|join }}")
    assert tok.apply_chat_template(MESSAGES) == ('<user>HI, <user>HI, <user>HI 3 012    ab|   7 a-b   x  | '
                                                 '[{"role": "user", "content": "hi"}] 1024 012')


@pytest.mark.parametrize("source, message", [
    ("{% for m in messages %}", "does not parse"),
    ("x" * (chat_template.MAX_SOURCE + 1), "characters long"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
])
def test_failures_are_chat_template_errors(tok, source, message):
    tok.chat_template = source
    with pytest.raises(ChatTemplateError, match=message):
        tok.apply_chat_template(MESSAGES)
