"""Chat templates are bounded (issue 38, item 3): localrt.engines.chattemplate.

A template that takes more than a second, renders more than the context's worth of
text, reaches for Python's internals or fails to render is refused (TemplateRefused:
400 invalid_chat_template naming the model), within the second, in the thread that
rendered it; its own raise_exception() stays the 400 invalid_field on 'messages'. The
templates run first on their own, then inside real tiny GGUFs chatted with.
"""

from __future__ import annotations

import threading
import time

import pytest
from emulators.chattemplates import TEMPLATES
from emulators.ggufgen import CHATML_TEMPLATE, write_gguf
from support.models import add_model

from localrt.engines.chattemplate import (BYTES_PER_TOKEN, TIME_LIMIT, ChatTemplate,
                                          MessagesRefused, TemplateRefused)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi | there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again."}]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")

# name -> (template, words its refusal says)
HOSTILE = {
    "two loops of 1e5": (NESTED_LOOPS, "took more than 1 s"),
    "loops over lists": ("{% set big = range(100000)|list %}{% for a in big %}"
                         "{% for b in big %}{% endfor %}{% endfor %}", "took more than 1 s"),
    "a repeated string": ("{{ 'x' * 1000000000 }}", "larger than"),
    "a power": ("{{ 2 ** 1000000000 }}", "larger than"),
    "a centred string": ("{{ 'x'|center(1000000000) }}", "larger than"),
    "a printf width": ("{{ '%01000000000d' % 1 }}", "larger than"),
    "a format width": ("{{ '{:>1000000000}'.format('x') }}", "larger than"),
    "a doubling namespace": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                             "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "larger than"),
    "a doubling macro": ("{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}",
                         "larger than"),
    "a replace that grows": ("{{ ('x' * 60000)|replace('x', 'y' * 60000) }}", "larger than"),
    "a join that grows": ("{{ (['x' * 60000] * 100000)|join }}", "larger than"),
    "a long output": ("{% for i in range(100000) %}{% for j in range(100) %}"
                      "{{ 'long text ' * 10 }}{% endfor %}{% endfor %}", "larger than"),
    "lipsum": ("{{ lipsum(n=100000) }}", "larger than"),
    "an indent that grows": ("{{ ('\\n' * 60000)|indent(60000) }}", "larger than"),
    "internals": ("{{ ''.__class__.__mro__ }}", "Python's internals"),
    "internals by attr": ("{{ ''|attr('__class__') }}", "Python's internals"),
    "internals by item": ("{{ messages['__class__'] }}", "Python's internals"),
    "internals by format": ("{{ '{0.__class__}'.format('') }}", "Python's internals"),
    "a broken for": ("{% for m in messages %}{{ m.content }}", "does not compile"),
    "a syntax error": ("{{ messages[0 }}", "does not compile"),
    "a failing for": ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
                      "failed to render"),
    "an unknown filter": ("{{ messages|nosuchfilter }}", "does not compile"),
    "an include": ("{% include 'other' %}", "failed to render"),
    "deep recursion": ("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}",
                       "recursed too deeply"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_refused_within_its_second(name):
    template, said = HOSTILE[name]
    threads = threading.active_count()
    started = time.monotonic()
    with pytest.raises(TemplateRefused) as refused:
        ChatTemplate(template, "</s>", "<s>", context=4096).render(CHAT)
    assert said in str(refused.value)
    assert time.monotonic() - started < TIME_LIMIT + 1.0
    assert threading.active_count() == threads  # nothing left running after it


def test_internals_are_refused_before_anything_runs():
    started = time.monotonic()
    with pytest.raises(TemplateRefused, match="never run"):
        ChatTemplate("{{ ''.__class__.__mro__ }}" + NESTED_LOOPS, "</s>", "<s>", 4096)
    assert time.monotonic() - started < 0.5  # refused when compiled: the loops never ran


def test_the_bound_is_the_contexts_worth_plus_the_request():
    template = "{{ messages[0]['content'] * 4 }}"
    small = ChatTemplate(template, "</s>", "<s>", context=16)
    with pytest.raises(TemplateRefused, match="larger than"):
        small.render([{"role": "user", "content": "x" * 16 * BYTES_PER_TOKEN}])
    # A request's own text may be rendered more than once without blame.
    long = [{"role": "user", "content": "y" * 40 * BYTES_PER_TOKEN}]
    echo = ChatTemplate("{{ messages[0]['content'] }}{{ messages[0]['content'] }}",
                        "</s>", "<s>", context=16)
    assert len(echo.render(long)) == 80 * BYTES_PER_TOKEN


def test_raise_exception_stays_the_templates_refusal_of_the_messages():
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
                "{% endif %}")
    with pytest.raises(MessagesRefused, match="no system"):
        ChatTemplate(template, "</s>", "<s>", 4096).render(CHAT)


@pytest.mark.parametrize("family", [*sorted(TEMPLATES), "chatml"])
def test_prompts_are_those_llama_cpp_python_renders(family):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = TEMPLATES.get(family, CHATML_TEMPLATE)
    ours = ChatTemplate(template, "</s>", "<s>", 4096)
    theirs = Jinja2ChatFormatter(template, "</s>", "<s>")
    for tools in (None, TOOLS):
        assert ours.render(CHAT, tools) == theirs(messages=CHAT, tools=tools).prompt


# --- inside real models, chatted with ----------------------------------------------

LIVE = {"slow": NESTED_LOOPS, "internals": "{{ ''.__class__.__mro__ }}" + NESTED_LOOPS,
        "broken": "{% for m in messages %}{{ m.content }}",
        "failing": "{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
        "huge": "{{ 'x' * 1000000000 }}",
        "picky": "{{ raise_exception('this model takes no system message') }}"}


@pytest.fixture(scope="module")
def hostile_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    return {name: write_gguf(root / f"{name}.gguf", name=name, chat_template=template)
            for name, template in LIVE.items()}


def _chat(api, model):
    return api("POST", "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                                "messages": CHAT})


@pytest.mark.live
@pytest.mark.parametrize("name", ["slow", "internals", "broken", "failing", "huge"])
def test_a_chat_with_a_hostile_template_is_a_400_naming_the_model(api, hostile_models, name):
    add_model(api, hostile_models[name], name)
    started = time.monotonic()
    r = _chat(api, name)
    assert r.status == 400, r.body
    assert r.json["error"]["code"] == "invalid_chat_template"
    assert f"Model {name}'s chat template is refused" in r.json["message"]
    assert time.monotonic() - started < 5.0  # the model's start, and a second at most
    again = _chat(api, name)  # the same, each time; the model is still there
    assert again.status == 400 and again.json["error"]["code"] == "invalid_chat_template"
    r = api("POST", "/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 2})
    assert r.status == 200, r.body  # no template: the model itself is fine


@pytest.mark.live
def test_raise_exception_is_still_invalid_field_on_messages(api, hostile_models):
    add_model(api, hostile_models["picky"], "picky")
    r = _chat(api, "picky")
    assert r.status == 400 and r.json["error"]["code"] == "invalid_field", r.body
    assert r.json["error"]["param"] == "messages"
    assert "this model takes no system message" in r.json["message"]
