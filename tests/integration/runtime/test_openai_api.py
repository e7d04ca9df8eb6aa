"""The OpenAI routes (/v1/completions, /v1/chat/completions) and the native /generate over real HTTP.

``builtin:tiny`` (byte tokenizer, no chat template) covers what needs no template; a synthesized Qwen3
checkpoint covers chat, with transformers' AutoTokenizer of the same directory as the oracle for the
rendered prompt and for decoding.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from cache_runtime.synth.checkpoint import write_checkpoint
from tests.integration.runtime.conftest import sse_events

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def _events(resp: httpx.Response) -> list:
    assert resp.status_code == 200, resp.read()
    return sse_events(resp)


def _stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        return _events(r)


def _bad(client: httpx.Client, path: str, body: dict, *needles: str) -> str:
    r = client.post(path, json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    return err["message"]


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny(start_server):
    return start_server("--context-length", "256", "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "tiny-qwen3", dtype="float32")


@pytest.fixture(scope="module")
def oracle(ckpt):
    return AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def chat(start_server, ckpt):
    """Context 512 (config.json), KV pool 384: a default chat budget is capped by the pool."""
    return start_server("--model-path", str(ckpt), "--max-total-tokens", "384", "--enable-cache-report",
                        "--served-model-name", "qwen3-test")


def _prompt_ids(oracle, messages, **kwargs) -> list[int]:
    return list(oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"])


@pytest.fixture(scope="module")
def first_token(chat, oracle) -> int:
    """The first greedy token the checkpoint generates for MESSAGES."""
    with chat.client() as c:
        r = c.post("/generate", json={"input_ids": _prompt_ids(oracle, MESSAGES),
                                      "sampling_params": {"max_new_tokens": 1}})
    return r.json()["output_ids"][0]


@pytest.fixture(scope="module")
def configured(start_server, ckpt, first_token, tmp_path_factory):
    """The same weights with a generation_config.json like Qwen3's (sampling defaults) whose EOS ids also
    hold the first greedy token of MESSAGES (so EOS is hit independently of the random logits), served
    with a 128-token context."""
    d = tmp_path_factory.mktemp("configured") / "ckpt"
    shutil.copytree(ckpt, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(eos_token_id=[gen["eos_token_id"], first_token], temperature=1.5, top_k=1)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return start_server("--model-path", str(d), "--context-length", "128")


# ------------------------------------------------------------------------------------------ completions
def test_completions_stream_joins_to_the_text_greedy_and_seeded(tiny):
    with tiny.client() as c:
        for params in ({}, {"temperature": 1.0, "seed": 7, "top_k": 50, "top_p": 0.95, "min_p": 0.02}):
            body = {"prompt": "The quick brown fox", "max_tokens": 24, **params}
            plain = c.post("/v1/completions", json=body).json()
            events = _stream(c, "/v1/completions", body)
            assert events[-1] == "[DONE]"
            usage_chunk, chunks = events[-2], events[:-2]
            assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
            assert all(ch["usage"] is None for ch in chunks)
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == plain["choices"][0]["text"]
            assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "length"
            assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
            assert plain["usage"]["completion_tokens"] == 24 and plain["usage"]["prompt_tokens_details"] is None
        greedy = c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 24}).json()
        sampled = c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 24,
                                                  "temperature": 1.0, "seed": 7}).json()
    assert sampled["choices"][0]["text"] != greedy["choices"][0]["text"]


def test_completions_defaults_to_16_tokens_and_greedy(tiny):
    with tiny.client() as c:
        a = c.post("/v1/completions", json={"prompt": "defaults"}).json()
        b = c.post("/generate", json={"text": "defaults", "sampling_params": {"max_new_tokens": 16}}).json()
    assert a["usage"] == {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24, "prompt_tokens_details": None}
    assert a["choices"][0]["text"] == b["text"] and a["choices"][0]["matched_stop"] is None


def test_min_p_and_top_k_of_one_sample_the_greedy_token(tiny):
    """min_p = 1 keeps only the most likely token, as does top_k = 1, whatever the temperature and seed."""
    body = {"prompt": "Sampling filters", "max_tokens": 12}
    with tiny.client() as c:
        greedy = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        hot = [c.post("/v1/completions", json={**body, "temperature": 2.0, "seed": s}).json()["choices"][0]["text"]
               for s in (1, 2)]
        for extra in ({"min_p": 1.0}, {"top_k": 1}):
            for seed in (1, 2):
                r = c.post("/v1/completions", json={**body, "temperature": 2.0, "seed": seed, **extra}).json()
                assert r["choices"][0]["text"] == greedy, extra
        native = c.post("/generate", json={"text": "Sampling filters", "sampling_params": {
            "max_new_tokens": 12, "temperature": 2.0, "seed": 1, "min_p": 1.0}}).json()
    assert all(t != greedy for t in hot)  # without the filter, this temperature leaves the greedy path
    assert native["text"] == greedy


def test_stop_token_ids_end_the_output_without_showing_the_token(tiny):
    with tiny.client() as c:
        ids = c.post("/generate", json={"text": "stop here", "sampling_params": {"max_new_tokens": 8}}).json()["output_ids"]
        body = {"prompt": "stop here", "max_tokens": 8, "stop_token_ids": [ids[2]]}
        r = c.post("/v1/completions", json=body).json()
        events = _stream(c, "/v1/completions", body)
        native = c.post("/generate", json={"text": "stop here",
                                           "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [ids[2]]}}).json()
    stop_at = ids.index(ids[2]) + 1
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == ids[2]
    assert r["usage"]["completion_tokens"] == stop_at
    assert choice["text"] == bytes(ids[:stop_at - 1]).decode("utf-8", errors="replace")
    assert "".join(ch["choices"][0]["text"] for ch in events[:-2]) == choice["text"]
    assert events[-3]["choices"][0]["matched_stop"] == ids[2]
    assert native["output_ids"] == ids[:stop_at] and native["text"] == choice["text"]
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}


def test_stop_strings_are_cut_and_never_streamed(tiny):
    """The stream holds back text that may still become a stop string, so no piece of one is sent."""
    with tiny.client() as c:
        text = c.post("/v1/completions", json={"prompt": "A stop string", "max_tokens": 40}).json()["choices"][0]["text"]
        j = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
        stop = text[j:j + 2]
        body = {"prompt": "A stop string", "max_tokens": 40, "stop": [stop, "never-matches"]}
        r = c.post("/v1/completions", json=body).json()
        events = _stream(c, "/v1/completions", body)
    assert r["choices"][0]["text"] == text[:text.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["matched_stop"] == stop
    pieces = [ch["choices"][0]["text"] for ch in events[:-2]]
    assert "".join(pieces) == r["choices"][0]["text"]
    assert events[-3]["choices"][0]["matched_stop"] == stop


@pytest.mark.parametrize("body,needles", [
    ({"prompt": "x", "min_p": 1.5}, ["min_p"]),
    ({"prompt": "x", "min_p": -0.1}, ["min_p"]),
    ({"prompt": "x", "top_k": 0}, ["top_k"]),
    ({"prompt": "x", "top_k": -2}, ["top_k"]),
    ({"prompt": "x", "top_p": 0}, ["top_p"]),
    ({"prompt": "x", "temperature": -1}, ["temperature"]),
    ({"prompt": "x", "max_tokens": -1}, ["max_tokens"]),
    ({"prompt": "x", "stop_token_ids": [256]}, ["stop_token_ids", "256"]),
    ({"prompt": "x", "presence_penalty": 0.5}, ["presence_penalty"]),
    ({"prompt": "x", "logprobs": 2}, ["logprobs"]),
    ({"prompt": "x", "n": 2}, ["n=1"]),
    ({"prompt": "x" * 200, "max_tokens": 100}, ["200", "100", "256"]),
])
def test_bad_completions_name_the_field(tiny, body, needles):
    with tiny.client() as c:
        _bad(c, "/v1/completions", body, *needles)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_generate_sampling_params_are_validated(tiny):
    with tiny.client() as c:
        _bad(c, "/generate", {"text": "x", "sampling_params": {"min_p": 2}}, "min_p")
        _bad(c, "/generate", {"text": "x", "sampling_params": {"top_k": 0}}, "top_k")
        _bad(c, "/generate", {"text": "x" * 250, "sampling_params": {"max_new_tokens": 10}}, "250", "10", "256")
        # a batch with one bad prompt runs none of them
        _bad(c, "/generate", {"input_ids": [[1, 2], [3, 999]], "sampling_params": {"max_new_tokens": 1}}, "999")


def test_builtin_model_has_no_chat_template(tiny):
    with tiny.client() as c:
        _bad(c, "/v1/chat/completions", {"messages": MESSAGES}, "no chat template")
        models = c.get("/v1/models").json()
        info = c.get("/model_info").json()
        assert c.get("/health_generate").status_code == 200
        server = c.get("/server_info").json()
    assert models["data"][0]["id"] == "builtin:tiny" and models["data"][0]["max_model_len"] == 256
    assert {k: info[k] for k in ("model_path", "served_model_name", "tokenizer_path", "is_generation", "load_format")} \
        == {"model_path": "builtin:tiny", "served_model_name": "builtin:tiny", "tokenizer_path": None,
            "is_generation": True, "load_format": "dummy"}
    assert server["context_length_effective"] == 256 and server["dtype_effective"] in ("float32", "bfloat16")


# ------------------------------------------------------------------------------------------ chat
def test_chat_prompt_is_the_rendered_template(chat, oracle):
    """The prompt token count matches transformers' rendering, and the chat output is the one /generate
    gives for transformers' token ids (so the ids agree, not only their number)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}}}]
    cases = [
        (MESSAGES, {}, {}),
        ([{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}], {},
         {"oracle_messages": [{"role": "user", "content": "two parts"}]}),
        ([*MESSAGES, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}], {}, {}),
        (MESSAGES, {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
        (MESSAGES, {"tools": tools}, {"tools": [tools[0]["function"]]}),
        (MESSAGES, {"tools": tools, "tool_choice": "none"}, {}),
    ]
    with chat.client() as c:
        for messages, extra, oracle_kwargs in cases:
            oracle_messages = oracle_kwargs.pop("oracle_messages", messages)
            ids = _prompt_ids(oracle, oracle_messages, **oracle_kwargs)
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, **extra})
            assert r.status_code == 200, r.text
            r = r.json()
            native = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6}}).json()
            assert r["usage"]["prompt_tokens"] == len(ids), extra
            assert r["choices"][0]["message"]["content"] == native["text"], extra


def test_chat_stream_matches_non_stream_and_reports_usage(chat, oracle):
    body = {"messages": MESSAGES, "max_completion_tokens": 20}
    with chat.client() as c:
        plain = c.post("/v1/chat/completions", json=body).json()
        events = _stream(c, "/v1/chat/completions", body)
        again = c.post("/v1/chat/completions", json=body).json()
    n_prompt = len(_prompt_ids(oracle, MESSAGES))
    choice = plain["choices"][0]
    assert plain["object"] == "chat.completion" and plain["model"] == "qwen3-test"
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["matched_stop"] is None
    assert plain["usage"]["prompt_tokens"] == n_prompt and plain["usage"]["completion_tokens"] == 20
    assert plain["usage"]["total_tokens"] == n_prompt + 20
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # --enable-cache-report

    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    assert all(ch["object"] == "chat.completion.chunk" and ch["usage"] is None for ch in chunks)
    assert len({ch["id"] for ch in events[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert content == choice["message"]["content"]


def test_chat_default_budget_fills_what_the_kv_pool_leaves(chat, oracle):
    with chat.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json()
    n_prompt = len(_prompt_ids(oracle, MESSAGES))
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 384 - n_prompt


def test_chat_stop_token_and_stop_string(chat, first_token):
    with chat.client() as c:
        greedy = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 30}).json()
        by_token = {"messages": MESSAGES, "max_tokens": 30, "stop_token_ids": [first_token]}
        stopped = c.post("/v1/chat/completions", json=by_token).json()
        streamed = _stream(c, "/v1/chat/completions", by_token)
        text = greedy["choices"][0]["message"]["content"]
        j = next(i for i in range(1, len(text) - 1) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
        stop = text[j:j + 2]
        by_string = {"messages": MESSAGES, "max_tokens": 30, "stop": stop}
        cut = c.post("/v1/chat/completions", json=by_string).json()
        cut_stream = _stream(c, "/v1/chat/completions", by_string)
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == first_token
    assert choice["message"]["content"] == "" and stopped["usage"]["completion_tokens"] == 1
    assert streamed[-3]["choices"][0]["finish_reason"] == "stop"
    assert streamed[-3]["choices"][0]["matched_stop"] == first_token
    assert cut["choices"][0]["message"]["content"] == text[:text.find(stop)]
    assert cut["choices"][0]["matched_stop"] == stop
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in cut_stream[:-2]) == text[:text.find(stop)]


def test_generate_decodes_with_the_checkpoint_tokenizer(chat, oracle):
    """/generate tokenizes text and decodes outputs as transformers does, special tokens skipped unless asked."""
    prompt = "Hello, wörld! 你好 🙂"
    params = {"max_new_tokens": 300, "temperature": 5.0, "ignore_eos": True}
    special = {i for i, t in oracle.added_tokens_decoder.items() if t.special}
    with chat.client() as c:
        for seed in range(8):
            r = c.post("/generate", json={"text": prompt, "sampling_params": {**params, "seed": seed}}).json()
            if set(r["output_ids"]) & special:
                break
        else:
            pytest.fail("no sampled output holds a special token")
        raw = c.post("/generate", json={"text": prompt, "sampling_params": {
            **params, "seed": seed, "skip_special_tokens": False}}).json()
    assert r["meta_info"]["prompt_tokens"] == len(oracle(prompt)["input_ids"])
    assert raw["output_ids"] == r["output_ids"] and len(r["output_ids"]) == 300
    assert r["text"] == oracle.decode(r["output_ids"], skip_special_tokens=True)
    assert raw["text"] == oracle.decode(r["output_ids"], skip_special_tokens=False) != r["text"]


@pytest.mark.parametrize("body,needles", [
    ({"messages": []}, ["messages"]),
    ({}, ["messages"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, ["role"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["content", "image_url", "text only"]),
    ({"messages": [{"role": "user", "content": 5}]}, ["content"]),
    ({"messages": [*MESSAGES, {"role": "system", "content": "late"}]}, ["A system message is only allowed first."]),
    ({"messages": MESSAGES, "n": 2}, ["n=1"]),
    ({"messages": MESSAGES, "max_tokens": 600}, ["600", "512"]),
    ({"messages": MESSAGES, "max_completion_tokens": 450}, ["450", "384"]),
    ({"messages": MESSAGES, "top_k": 0}, ["top_k"]),
    ({"messages": MESSAGES, "min_p": 3}, ["min_p"]),
    ({"messages": MESSAGES, "stop_token_ids": [5000]}, ["stop_token_ids"]),
    ({"messages": MESSAGES, "logprobs": True}, ["logprobs"]),
    ({"messages": MESSAGES, "tool_choice": "required"}, ["tool_choice"]),
    ({"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, ["chat_template_kwargs"]),
    ({"messages": MESSAGES, "frequency_penalty": 1.0}, ["frequency_penalty"]),
])
def test_bad_chat_requests_name_the_field(chat, body, needles):
    with chat.client() as c:
        _bad(c, "/v1/chat/completions", body, *needles)
        assert c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200


def test_chat_prompt_beyond_the_context_is_400(chat):
    long = [{"role": "user", "content": " ".join(["colour"] * 600)}]
    with chat.client() as c:
        _bad(c, "/v1/chat/completions", {"messages": long}, "384", "512")
        _bad(c, "/v1/chat/completions", {"messages": long, "max_tokens": 5}, "5", "512")


def test_model_info_routes_name_the_served_model(chat, ckpt):
    with chat.client() as c:
        models = c.get("/v1/models").json()
        info = c.get("/get_model_info").json()
        assert c.get("/health_generate").status_code == 200
    assert [m["id"] for m in models["data"]] == ["qwen3-test"] and models["data"][0]["max_model_len"] == 512
    assert {k: info[k] for k in ("model_path", "served_model_name", "tokenizer_path", "load_format")} \
        == {"model_path": str(ckpt), "served_model_name": "qwen3-test", "tokenizer_path": str(ckpt),
            "load_format": "auto"}
    assert info["architectures"] == ["Qwen3ForCausalLM"] and info["model_type"] == "qwen3"


@pytest.fixture(scope="module")
def llama(start_server, tmp_path_factory):
    """A Llama-3-style checkpoint: its template writes BOS itself and its tokenizer adds BOS to plain text."""
    d = write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "tiny-llama", dtype="float32",
                         tokenizer_template="llama3")
    return start_server("--model-path", str(d)), AutoTokenizer.from_pretrained(str(d))


def test_special_tokens_are_added_to_prompts_but_not_to_rendered_chats(llama):
    """A rendered chat already holds BOS (tokenized with add_special_tokens=False, so one BOS); a
    completion prompt is tokenized with them (BOS prepended), as transformers and SGLang do."""
    server, tok = llama
    prompt = "Once upon a time"
    with server.client() as c:
        chat_r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5}).json()
        native = c.post("/generate", json={"input_ids": _prompt_ids(tok, MESSAGES),
                                           "sampling_params": {"max_new_tokens": 5}}).json()
        completion = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}).json()
        by_ids = c.post("/v1/completions", json={"prompt": tok(prompt)["input_ids"], "max_tokens": 5}).json()
    assert chat_r["usage"]["prompt_tokens"] == len(_prompt_ids(tok, MESSAGES))
    assert chat_r["choices"][0]["message"]["content"] == native["text"]
    assert tok(prompt)["input_ids"][0] == tok.bos_token_id
    assert completion["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"])
    assert completion["choices"][0]["text"] == by_ids["choices"][0]["text"]


# ------------------------------------------------------------------------------------------ generation_config.json
def test_eos_ends_the_output_unless_ignore_eos(configured, first_token, oracle):
    body = {"messages": MESSAGES, "max_tokens": 10}
    native = {"input_ids": _prompt_ids(oracle, MESSAGES), "sampling_params": {"max_new_tokens": 3}}
    with configured.client() as c:
        stopped = c.post("/v1/chat/completions", json=body).json()
        ignored = c.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()
        native_stopped = c.post("/generate", json=native).json()
        native["sampling_params"]["ignore_eos"] = True
        native_ignored = c.post("/generate", json=native).json()
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == first_token
    assert choice["message"]["content"] == "" and stopped["usage"]["completion_tokens"] == 1
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 10
    assert native_stopped["output_ids"] == [first_token] and native_stopped["text"] == ""
    assert native_stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first_token}
    assert len(native_ignored["output_ids"]) == 3 and native_ignored["output_ids"][0] == first_token


def test_generation_config_supplies_unset_sampling_fields(configured):
    """generation_config.json sets temperature 1.5 and top_k 1: unset fields take them, set ones win."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16, "ignore_eos": True}

    def content(c, **kw):
        r = c.post("/v1/chat/completions", json={**body, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    with configured.client() as c:
        greedy = content(c, temperature=0)
        assert content(c, seed=1) == content(c, seed=2) == greedy  # top_k 1 from the file
        open_k = [content(c, seed=s, top_k=-1) for s in (1, 2, 3)]
        explicit = [content(c, seed=s, top_k=-1, temperature=1.5) for s in (1, 2, 3)]
    assert open_k == explicit  # the file's temperature applies when the request sets none
    assert any(t != greedy for t in open_k)


def test_default_budget_is_what_the_context_leaves(configured, oracle):
    with configured.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json()
        info = c.get("/server_info").json()
    assert r["usage"]["completion_tokens"] == 128 - len(_prompt_ids(oracle, MESSAGES))
    assert info["context_length_effective"] == 128 and info["dtype_effective"] == "float32"
