"""cache_runtime.tokenization against transformers (the oracle), on tokenizers written by cache_runtime.synth.

Each synthesized checkpoint is loaded twice, by ``AutoTokenizer.from_pretrained`` and by ``load_tokenizer``;
encode, decode, special ids and streaming decode must agree. Variants of tokenizer_config.json check that
the special-token rules follow transformers', and broken files that the refusal names the file and field.
"""

from __future__ import annotations

import codecs

import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_runtime.models.config import CheckpointError
from cache_runtime.synth.tokenizer import build_tokenizer, write_tokenizer
from cache_runtime.tokenization import ByteTokenizer, ChatTemplateError, load_tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATES = ("chatml", "llama3")

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox didn't jump over 12345 lazy dogs, did it?",
    "  leading spaces,   runs\t\ttabs\n\n\nand newlines  \n",
    "    def f(x):\n        return x ** 2\n",
    "今天天气很好，我们一起去公园散步吧。",
    "東京の駅はとても大きい。오늘 저녁에 만나요. Привет, мир!",
    "emoji 🎉🚀 family 👨‍👩‍👧 skin 👍🏽 flag 🇫🇷",
    "cafe\u0301 vs café, naïve façade",  # NFD input: chatml normalizes to NFC
    "text with <|im_start|>user\nspecial<|im_end|> tokens inside",
    "llama <|begin_of_text|>header<|eot_id|> tokens and <|start_header_id|>",
    "reasoning <think>hmm</think> and <tool_call>{}</tool_call>",
    "almost special <|im_end| and <think",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "a" * 300,
]


def copy_dir(src: Path, dst: Path, **config_changes) -> Path:
    """The checkpoint in ``src`` with tokenizer_config keys changed (None removes the key)."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Per template, the directory written by write_tokenizer and what it returned."""
    root = tmp_path_factory.mktemp("tok")
    return {template: (root / template, write_tokenizer(root / template, template=template)) for template in TEMPLATES}


@pytest.fixture(scope="module")
def dirs(written) -> dict[str, Path]:
    return {template: d for template, (d, _) in written.items()}


@pytest.fixture(scope="module", params=TEMPLATES)
def pair(request, dirs):
    """(transformers tokenizer, ours) for one template family."""
    d = dirs[request.param]
    return transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)


def assert_same_tokenizer(hf, ours, texts=TEXTS) -> None:
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf(text, add_special_tokens=add)["input_ids"], text
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


# ------------------------------------------------------------------------------------ synthesized files


@pytest.mark.parametrize("template, eos, pad, bos", [
    ("chatml", "<|im_end|>", "<|endoftext|>", None),
    ("llama3", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"),
])
def test_write_tokenizer_reports_the_ids_in_its_files(written, template, eos, pad, bos):
    d, info = written[template]
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert info == {"vocab_size": 4096, "eos_token_id": hf.convert_tokens_to_ids(eos),
                    "pad_token_id": hf.convert_tokens_to_ids(pad),
                    "bos_token_id": None if bos is None else hf.convert_tokens_to_ids(bos)}
    assert len(hf) == 4096
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (
        info["eos_token_id"], info["pad_token_id"], info["bos_token_id"])


def test_same_seed_same_files_other_seed_other_vocabulary(dirs, tmp_path):
    write_tokenizer(tmp_path, template="chatml")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (dirs["chatml"] / name).read_bytes(), name
    seed0 = tokenizers.Tokenizer.from_file(str(dirs["chatml"] / "tokenizer.json")).get_vocab()
    assert build_tokenizer(vocab_size=4096, seed=1).get_vocab() != seed0


def test_training_learns_real_merges(dirs):
    tok = tokenizers.Tokenizer.from_file(str(dirs["llama3"] / "tokenizer.json"))
    # common words and a repeated CJK phrase become single tokens
    for word in (" the", " world", " people", "今天"):
        assert len(tok.encode(word, add_special_tokens=False).ids) == 1, word
    sentence = "The people said they would come back to the old house before evening."
    assert len(tok.encode(sentence, add_special_tokens=False).ids) <= len(sentence.split()) + 2


def test_unknown_template_and_tiny_vocab_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown template"):
        write_tokenizer(tmp_path, template="alpaca")
    with pytest.raises(ValueError, match="vocab_size"):
        write_tokenizer(tmp_path, vocab_size=200)


# ------------------------------------------------------------------------------------ encode / decode


def test_encode_and_decode_match_transformers(pair):
    assert_same_tokenizer(*pair)


def test_llama3_prepends_bos_and_chatml_does_not(dirs):
    llama, chatml = load_tokenizer(dirs["llama3"]), load_tokenizer(dirs["chatml"])
    assert llama.encode("hi")[0] == llama.bos_token_id
    assert llama.encode("hi", add_special_tokens=False)[0] != llama.bos_token_id
    assert chatml.bos_token_id is None
    assert chatml.encode("hi") == chatml.encode("hi", add_special_tokens=False)


def test_decode_of_random_ids_matches_transformers(pair):
    hf, ours = pair
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens_are_skipped_but_markup_tokens_stay(dirs):
    ours = load_tokenizer(dirs["chatml"])
    ids = ours.encode("<|im_start|>assistant\n<think>x</think>done<|im_end|>")
    assert ours.decode(ids) == "assistant\n<think>x</think>done"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\n<think>x</think>done<|im_end|>"


def test_special_ids_match_transformers(pair):
    hf, ours = pair
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_ids == {hf.eos_token_id}
    assert ours.bos_token_id == hf.bos_token_id


def test_extra_eos_ids_join_the_configured_one(dirs):
    ours = load_tokenizer(dirs["llama3"], extra_eos_ids=[4089, 4093])
    assert ours.eos_token_ids == {4089, 4093, ours.encode("<|eot_id|>", add_special_tokens=False)[0]}


def test_tokenizer_without_config_has_no_special_tokens(dirs, tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    shutil.copy(dirs["chatml"] / "tokenizer.json", d)
    ours = load_tokenizer(d)
    assert ours.eos_token_ids == frozenset() and ours.bos_token_id is None and not ours.has_chat_template
    assert_same_tokenizer(transformers.AutoTokenizer.from_pretrained(d), ours)


@pytest.mark.parametrize("changes", [
    # AddedToken objects instead of strings
    {"bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False,
                   "rstrip": False, "single_word": False, "special": True},
     "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False,
                   "rstrip": False, "single_word": False, "special": True}},
    # no added_tokens_decoder: transformers falls back to tokenizer.json's added tokens
    {"added_tokens_decoder": None},
    # a plain vocabulary token named as a special token becomes a special added token
    {"pad_token": "Ġthe", "added_tokens_decoder": None},
    # the config's flags override tokenizer.json's: a markup token made special is skipped by decode
    {"added_tokens_decoder": {"4092": {"content": "<think>", "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True}}},
    # unnamed special tokens, old and new spelling
    {"additional_special_tokens": ["<tool_call>", "</tool_call>"]},
    {"extra_special_tokens": ["<tool_call>"]},
    # special tokens encoded as text
    {"split_special_tokens": True},
    # ignored for BPE, as transformers does
    {"clean_up_tokenization_spaces": True},
    # a model-specific named token
    {"image_token": "<tool_call>"},
])
def test_config_variants_match_transformers(dirs, tmp_path, changes):
    template = "llama3" if "bos_token" in changes else "chatml"
    d = copy_dir(dirs[template], tmp_path / "variant", **changes)
    hf, ours = transformers.AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    texts = TEXTS + ["the cat and the dog", "Hello , world . It 's fine !"]
    assert_same_tokenizer(hf, ours, texts)
    assert ours.eos_token_ids == ({hf.eos_token_id} if hf.eos_token_id is not None else set())
    assert ours.bos_token_id == hf.bos_token_id


def test_config_variants_change_the_output(dirs, tmp_path):
    """The variants above are not no-ops: each changes what the default checkpoint does."""
    base = load_tokenizer(dirs["chatml"])
    think = base.encode("<think>", add_special_tokens=False)
    assert base.decode(think) == "<think>"
    d = copy_dir(dirs["chatml"], tmp_path / "think", added_tokens_decoder={str(think[0]): {
        "content": "<think>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True}})
    assert load_tokenizer(d).decode(think) == ""
    d = copy_dir(dirs["chatml"], tmp_path / "split", split_special_tokens=True)
    assert len(load_tokenizer(d).encode("<|im_end|>")) > 1
    d = copy_dir(dirs["chatml"], tmp_path / "pad", pad_token="Ġthe", added_tokens_decoder=None)
    assert load_tokenizer(d).decode(base.encode("the cat and the dog")) == "the cat and dog"


def test_clean_up_tokenization_spaces_applies_to_non_bpe_models(tmp_path):
    """transformers cleans " ," and " 's" only for models other than BPE (here a word-level one)."""
    words = ["[UNK]", "hello", ",", "world", ".", "it", "'s", "fine", "!"]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "tokenizer.json"))
    for clean_up, expected in ((True, "hello, world. it's fine!"), (False, "hello , world . it 's fine !")):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({
            "clean_up_tokenization_spaces": clean_up, "unk_token": "[UNK]", "tokenizer_class": "PreTrainedTokenizerFast"}))
        hf, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)
        ids = ours.encode("hello , world . it 's fine !")
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == expected


# ------------------------------------------------------------------------------------ refusals


def one_line_error(d: Path, *names: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(d)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, (name, message)
    return message


def test_missing_tokenizer_json_is_named(tmp_path):
    one_line_error(tmp_path, str(tmp_path / "tokenizer.json"), "missing")


def test_unreadable_tokenizer_json_is_named(dirs, tmp_path):
    d = copy_dir(dirs["chatml"], tmp_path / "c")
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    one_line_error(d, str(d / "tokenizer.json"), "unreadable")


def test_malformed_tokenizer_config_is_named(dirs, tmp_path):
    d = copy_dir(dirs["chatml"], tmp_path / "c")
    (d / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",')
    one_line_error(d, str(d / "tokenizer_config.json"), "unreadable")
    (d / "tokenizer_config.json").write_text("[1, 2]")
    one_line_error(d, str(d / "tokenizer_config.json"), "JSON object")


@pytest.mark.parametrize("changes, field", [
    ({"eos_token": "<|not_a_token|>"}, "eos_token"),
    ({"bos_token": 7}, "bos_token"),
    ({"image_token": "<|no_image|>"}, "image_token"),
    ({"additional_special_tokens": ["<tool_call>", "<|nope|>"]}, "additional_special_tokens[1]"),
    ({"added_tokens_decoder": {"5": {"content": "<|im_end|>", "special": True}}}, "added_tokens_decoder.5"),
    ({"added_tokens_decoder": {"x": {"content": "<|im_end|>"}}}, "added_tokens_decoder.x"),
    ({"split_special_tokens": "yes"}, "split_special_tokens"),
    ({"chat_template": 42}, "chat_template"),
    ({"chat_template": "{% if messages %}unclosed"}, "chat_template"),
])
def test_bad_config_fields_are_named(dirs, tmp_path, changes, field):
    d = copy_dir(dirs["chatml"], tmp_path / "c", **changes)
    one_line_error(d, str(d / "tokenizer_config.json"), field)


# ------------------------------------------------------------------------------------ streaming decode


def stream(tok, ids: list[int], cuts: list[int], skip: bool = True) -> list[str]:
    """feed() outputs for ``ids`` cut into chunks at ``cuts``, then flush()."""
    decoder = tok.decoder(skip_special_tokens=skip)
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    return [decoder.feed(ids[a:b]) for a, b in zip(bounds, bounds[1:])] + [decoder.flush()]


@pytest.fixture(scope="module")
def loaded(dirs):
    return {t: load_tokenizer(dirs[t]) for t in TEMPLATES}


@pytest.fixture(scope="module")
def byte_ids(dirs) -> dict[str, list[int]]:
    """Per template, the id of each single-byte token (ByteLevel spells byte b as GPT-2's printable char)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in printable)})
    out = {}
    for template in TEMPLATES:
        backend = tokenizers.Tokenizer.from_file(str(dirs[template] / "tokenizer.json"))
        out[template] = [backend.token_to_id(spelling[b]) for b in range(256)]
        assert None not in out[template]
    return out


def as_bytes(byte_ids: list[int], text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte: every multi-byte character is split across tokens."""
    return [byte_ids[b] for b in text.encode("utf-8")]


UNICODE_TEXT = st.text(alphabet=st.sampled_from(list("ab ,.\n€é中文字👍🏽🎉🚀👨‍👩‍👧ñü日本語한국"))
                       | st.characters(exclude_categories=("Cs",)),  # no lone surrogates: not encodable text
                       max_size=40)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(template=st.sampled_from(TEMPLATES), text=UNICODE_TEXT, cuts=st.lists(st.integers(0, 200), max_size=12),
       by_bytes=st.booleans())
def test_streaming_valid_text_never_emits_replacement_characters(loaded, byte_ids, template, text, cuts,
                                                                 by_bytes):
    tok = loaded[template]
    ids = as_bytes(byte_ids[template], text) if by_bytes else tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids, cuts)
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces), pieces


@FAST
@given(template=st.sampled_from(TEMPLATES), data=st.data(), cuts=st.lists(st.integers(0, 200), max_size=12),
       skip=st.booleans())
def test_streaming_random_ids_joins_to_decode(loaded, template, data, cuts, skip):
    tok = loaded[template]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    pieces = stream(tok, ids, cuts, skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    # text ending in U+FFFD may still become a character: feed() holds it back, only flush() returns it
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1]), pieces


def test_streaming_holds_a_split_character_until_it_completes(loaded, byte_ids):
    tok = loaded["chatml"]
    ids = as_bytes(byte_ids["chatml"], "a中b")  # a, e4, b8, ad, b
    decoder = tok.decoder()
    assert [decoder.feed([i]) for i in ids] == ["a", "", "", "中", "b"]
    assert decoder.flush() == ""


def test_flush_returns_a_truly_unfinished_character(loaded, byte_ids):
    tok = loaded["llama3"]
    ids = as_bytes(byte_ids["llama3"], "ok中")[:-1]
    decoder = tok.decoder()
    assert decoder.feed(ids[:2]) == "ok"
    assert decoder.feed(ids[2:]) == ""
    assert decoder.flush() == "\ufffd"


def test_streaming_skips_special_tokens_unless_asked(loaded):
    tok = loaded["chatml"]
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert "".join(stream(tok, ids, [1, 2])) == "hi"
    assert "".join(stream(tok, ids, [1, 2], skip=False)) == "<|im_start|>hi<|im_end|>"


# ------------------------------------------------------------------------------------ byte tokenizer


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=50), data=st.binary(max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_byte_tokenizer_is_utf8_bytes_and_streams_like_the_stdlib_decoder(text, data, cuts):
    tok = ByteTokenizer()
    assert tok.encode(text) == tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    ids = list(data)
    assert tok.decode(ids) == tok.decode(ids, skip_special_tokens=False) == data.decode("utf-8", errors="replace")
    new, ref = tok.decoder(), codecs.getincrementaldecoder("utf-8")(errors="replace")
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        assert new.feed(ids[a:b]) == ref.decode(bytes(ids[a:b]))
    assert new.flush() == ref.decode(b"", final=True)


def test_byte_tokenizer_has_no_specials_and_no_template():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.eos_token_ids == frozenset() and tok.bos_token_id is None
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
