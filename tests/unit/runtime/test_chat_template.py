"""Chat templates: ``HFTokenizer.apply_chat_template`` renders exactly what transformers'
``apply_chat_template(..., tokenize=False)`` renders, and refuses what it refuses, with ChatTemplateError.

The synthesized chatml and llama3 templates cover system prompts, multi-turn, tools, tool calls and results,
reasoning, ``enable_thinking``, ``raise_exception``, namespaces and loop controls; small custom templates
cover the environment itself (tojson, generation blocks, special-token variables, template selection).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_runtime.models.config import CheckpointError
from cache_runtime.synth.tokenizer import CHAT_TEMPLATES, write_tokenizer
from cache_runtime.tokenization import ChatTemplateError, load_tokenizer
from tests.unit.runtime.test_tokenization import copy_dir

transformers = pytest.importorskip("transformers")

TEMPLATES = ("chatml", "llama3")
DATE = {"date_string": "26 Jul 2024"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle d'une ville <b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "user only": [{"role": "user", "content": "Hello!"}],
    "system and multi-turn": [
        {"role": "system", "content": "You are terse. Réponds en français."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 中文 + emoji 🎉?"},
    ],
    "reasoning under each name": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "  step one\n"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Done again.", "reasoning": "step two"},
        {"role": "user", "content": "Once more."},
        {"role": "assistant", "content": "Third.", "thinking": "step three"},
    ],
    "tool calls and results, None-valued keys": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        ]},
        {"role": "tool", "content": "18 C", "tool_call_id": "a", "name": None},
        {"role": "tool", "content": "9 C", "tool_call_id": "b"},
        {"role": "assistant", "content": "Paris 18 C, Oslo 9 C.", "tool_calls": None},
    ],
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    for template in TEMPLATES:
        write_tokenizer(root / template, vocab_size=1024, template=template)
    return {template: root / template for template in TEMPLATES}


@pytest.fixture(scope="module")
def pairs(dirs):
    return {t: (transformers.AutoTokenizer.from_pretrained(dirs[t]), load_tokenizer(dirs[t])) for t in TEMPLATES}


def with_template(base: Path, tmp_path: Path, template, name: str = "t"):
    d = copy_dir(base, tmp_path / name, chat_template=template)
    return transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)


def assert_same(hf, ours, messages, **kwargs) -> str:
    """Both render the same text; returns it."""
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected
    return expected


def assert_both_refuse(hf, ours, messages, **kwargs) -> str:
    """transformers raises (jinja2 errors, ValueError, TypeError), ours raises ChatTemplateError; returns ours."""
    with pytest.raises(Exception):
        hf.apply_chat_template(messages, tokenize=False, **kwargs)
    with pytest.raises(ChatTemplateError) as info:
        ours.apply_chat_template(messages, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------------------------ synthesized templates


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_conversations_render_like_transformers(pairs, template, name, add_generation_prompt):
    hf, ours = pairs[template]
    text = assert_same(hf, ours, CONVERSATIONS[name], add_generation_prompt=add_generation_prompt, **DATE)
    assert CONVERSATIONS[name][-1]["content"] in text


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_tools_render_like_transformers(pairs, template, name):
    hf, ours = pairs[template]
    text = assert_same(hf, ours, CONVERSATIONS[name], tools=TOOLS, add_generation_prompt=True, **DATE)
    assert "get_weather" in text and "Météo" in text and "<b>" in text  # tojson: no ASCII or HTML escaping


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_extra_kwargs_reach_the_template(pairs, enable_thinking):
    hf, ours = pairs["chatml"]
    text = assert_same(hf, ours, CONVERSATIONS["user only"], add_generation_prompt=True,
                       enable_thinking=enable_thinking)
    assert text.endswith("<think>\n\n</think>\n\n") != enable_thinking


def test_llama3_starts_with_bos_and_dates_the_system_header(pairs):
    hf, ours = pairs["llama3"]
    text = assert_same(hf, ours, CONVERSATIONS["user only"], add_generation_prompt=True)  # strftime_now
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Today: " in text
    assert ours.encode(text, add_special_tokens=False)[0] == ours.bos_token_id


def test_rendered_chat_encodes_like_transformers(pairs):
    for template in TEMPLATES:
        hf, ours = pairs[template]
        messages = CONVERSATIONS["system and multi-turn"]
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **DATE)
        text = ours.apply_chat_template(messages, add_generation_prompt=True, **DATE)
        assert ours.encode(text, add_special_tokens=False) == ids


def test_none_valued_keys_are_dropped(pairs):
    """A present-but-None content would render "None" or fail; dropped, it is just missing."""
    hf, ours = pairs["chatml"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    text = assert_same(hf, ours, messages, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<|im_end|>\n")


# ------------------------------------------------------------------------------------ refusals


def test_raise_exception_carries_the_template_message(pairs):
    hf, ours = pairs["llama3"]
    messages = [{"role": "narrator", "content": "Once upon a time"}]
    with pytest.raises(Exception) as hf_info:
        hf.apply_chat_template(messages, tokenize=False, **DATE)
    with pytest.raises(ChatTemplateError) as info:
        ours.apply_chat_template(messages, **DATE)
    assert str(info.value) == str(hf_info.value) == "Role narrator is not supported; use user, assistant or tool."
    hf, ours = pairs["chatml"]
    message = assert_both_refuse(hf, ours, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    assert message == "A system message is only allowed first."


def test_render_errors_become_chat_template_errors(pairs):
    hf, ours = pairs["chatml"]
    message = assert_both_refuse(hf, ours, [{"role": "user", "content": None}])  # '...' + undefined
    assert "chat template failed" in message and "Undefined" in message
    message = assert_both_refuse(hf, ours, [{"role": "user", "content": 5}])  # str + int
    assert "TypeError" in message


def test_empty_conversation_and_bad_messages_are_refused(pairs):
    hf, ours = pairs["chatml"]
    assert "empty conversation" in assert_both_refuse(hf, ours, [])
    assert "must be objects" in assert_both_refuse(hf, ours, ["hello"])
    assert "JSON schema" in assert_both_refuse(hf, ours, CONVERSATIONS["user only"], tools=["get_weather"])


def test_no_template(dirs, tmp_path):
    d = copy_dir(dirs["chatml"], tmp_path / "none", chat_template=None)
    hf, ours = transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    assert not ours.has_chat_template and load_tokenizer(dirs["chatml"]).has_chat_template
    assert "no chat template" in assert_both_refuse(hf, ours, CONVERSATIONS["user only"])


def test_template_that_does_not_compile_is_refused_at_load(dirs, tmp_path):
    d = copy_dir(dirs["chatml"], tmp_path / "bad", chat_template="{% for m in messages %}{{ m.content }}")
    with pytest.raises(CheckpointError, match="chat_template: does not compile: line 1"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ok"}))
    (d / "chat_template.jinja").write_text("{{ messages[0].content }")
    with pytest.raises(CheckpointError, match="chat_template.jinja: does not compile"):
        load_tokenizer(d)


# ------------------------------------------------------------------------------------ template selection


NAMED = [{"name": "default", "template": "default:{{ messages[0].content }}|{{ tools is none }}"},
         {"name": "tool_use", "template": "tools:{% for t in tools %}{{ t.function.name }}{% endfor %}"}]


def test_template_list_picks_tool_use_when_tools_are_given(dirs, tmp_path):
    hf, ours = with_template(dirs["chatml"], tmp_path, NAMED)
    assert assert_same(hf, ours, CONVERSATIONS["user only"]) == "default:Hello!|True"
    assert assert_same(hf, ours, CONVERSATIONS["user only"], tools=TOOLS) == "tools:get_weather"
    assert assert_same(hf, ours, CONVERSATIONS["user only"], tools=[]) == "tools:"


def test_template_list_without_default_needs_tools(dirs, tmp_path):
    hf, ours = with_template(dirs["chatml"], tmp_path, NAMED[1:])
    assert assert_same(hf, ours, CONVERSATIONS["user only"], tools=TOOLS) == "tools:get_weather"
    assert "none is named 'default'" in assert_both_refuse(hf, ours, CONVERSATIONS["user only"])


def test_chat_template_files_win_over_the_config(dirs, tmp_path):
    d = copy_dir(dirs["chatml"], tmp_path / "files")
    (d / "chat_template.jinja").write_text("from file: {{ messages[-1].content }}\n")
    hf, ours = transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    assert assert_same(hf, ours, CONVERSATIONS["user only"]) == "from file: Hello!"
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("tool file: {{ tools | length }}")
    hf, ours = transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    assert assert_same(hf, ours, CONVERSATIONS["user only"], tools=TOOLS) == "tool file: 1"
    assert assert_same(hf, ours, CONVERSATIONS["user only"]) == "from file: Hello!"


# ------------------------------------------------------------------------------------ the environment


@pytest.mark.parametrize("template, kwargs", [
    # tojson's arguments, unescaped non-ASCII and HTML
    ("{{ messages | tojson(indent=2, sort_keys=True) }}|{{ tools | tojson(separators=(',', ':')) }}", {"tools": TOOLS}),
    ("{{ {'b': 'é<&>', 'a': [1, none]} | tojson(ensure_ascii=true) }}", {}),
    # special tokens as variables; keyword arguments override them
    ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|{{ image_token }}", {}),
    ("{{ eos_token }}|{{ custom }}|{{ documents is none }}", {"eos_token": "END", "custom": [1, 2]}),
    ("{{ documents[0].title }}", {"documents": [{"title": "Doc", "text": "body"}]}),
    # {% generation %} renders its body; a set inside stays local to it
    ("{% set x = 'out' %}{% generation %}{% set x = 'in' %}[{{ x }}]{% endgeneration %}{{ x }}", {}),
    # namespaces, loop controls, whitespace control (trim_blocks, lstrip_blocks)
    ("{% set ns = namespace(n=0) %}\n  {% for m in messages %}\n    {% if loop.first %}{% continue %}{% endif %}"
     "{% set ns.n = ns.n + 1 %}{% if ns.n > 1 %}{% break %}{% endif %}{{ m.role }}\n  {% endfor %}\n{{ ns.n }}", {}),
    ("{{ dict(a=1, b=[2]) | tojson }}|{{ dict.fromkeys(['x'], 0) }}", {}),
    ("{{ strftime_now('%Y') | length }}|{{ add_generation_prompt }}", {"add_generation_prompt": True}),
])
def test_environment_matches_transformers(dirs, tmp_path, template, kwargs):
    d = copy_dir(dirs["llama3"], tmp_path / "env", chat_template=template, image_token="<|python_tag|>")
    hf, ours = transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    assert_same(hf, ours, CONVERSATIONS["system and multi-turn"], **kwargs)


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
])
def test_sandbox_refuses_like_transformers(dirs, tmp_path, template):
    hf, ours = with_template(dirs["chatml"], tmp_path, template)
    assert_both_refuse(hf, ours, CONVERSATIONS["user only"])


def test_templates_are_the_ones_written(dirs):
    for template in TEMPLATES:
        config = json.loads((dirs[template] / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHAT_TEMPLATES[template]
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert config["clean_up_tokenization_spaces"] is False
