"""The tokenizer files of a synthesized checkpoint: a byte-level BPE trained here, in two chat families.

``write_tokenizer`` trains on a corpus generated from a seed plus a fixed multilingual sample (accents,
CJK, emoji, code) that lives in this module, so the same package versions write the same files on every
machine, with no downloads. The files are what transformers reads: ``tokenizer.json`` and a
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, the special tokens and the chat template.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# Qwen-style ChatML: an optional system turn (tools are described there), <think> reasoning, tool calls
# as <tool_call> JSON, consecutive tool results grouped into one user turn.
_CHATML = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call the functions whose signatures are listed in <tools></tools>:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nTo call one, answer with a JSON object inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('A system message is only allowed first.') }}{% endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}
{{- '<think>\n' + message.reasoning_content.strip() + '\n</think>\n\n' }}
{%- endif %}
{%- generation %}
{%- if message.content %}
{{- message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endgeneration %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""

# Llama 3 style headers: BOS from the template, a system header that always carries the date (tools
# listed there as indented JSON), tool results under the ipython role, and only the roles it knows.
_LLAMA3 = r"""{{- bos_token }}
{%- set ns = namespace(system='', skip=0) %}
{%- if messages[0].role == 'system' %}
{%- set ns.system = messages[0].content | trim %}
{%- set ns.skip = 1 %}
{%- endif %}
{%- if date_string is not defined %}
{%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}
{{- 'Environment: ipython\n' }}
{%- endif %}
{{- 'Knowledge cutoff: March 2024\nToday: ' + date_string + '\n\n' }}
{%- if tools is not none %}
{{- 'Call a function when it helps, answering with JSON {"name": function name, "parameters": arguments}.\nFunctions:\n\n' }}
{%- for tool in tools %}
{{- tool | tojson(indent=2) + '\n\n' }}
{%- endfor %}
{%- endif %}
{{- ns.system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if loop.index0 < ns.skip %}
{%- continue %}
{%- endif %}
{%- if message.role not in ['user', 'assistant', 'tool', 'ipython'] %}
{{- raise_exception('Role ' + message.role + ' is not supported; use user, assistant or tool.') }}
{%- endif %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
{{- '{"name": "' + fn.name + '", "parameters": ' }}
{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
{{- '}' }}
{%- endfor %}
{{- '<|eom_id|>' }}
{%- elif message.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
{{- message.content | tojson if message.content is mapping else message.content }}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CHAT_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "llama3": _LLAMA3}


@dataclass(frozen=True)
class _Family:
    special: tuple[str, ...]  # control tokens, skipped by decode(skip_special_tokens=True)
    markup: tuple[str, ...]  # added tokens that stay in decoded text (reasoning / tool-call tags)
    bos: str | None
    eos: str
    pad: str
    prepend_bos: bool  # the post-processor puts BOS before every encoded text
    nfc: bool
    model_max_length: int


# Added tokens get the ids after the trained vocabulary, as in the families these imitate.
_FAMILIES = {
    "chatml": _Family(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        markup=("<think>", "</think>", "<tool_call>", "</tool_call>"),
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", prepend_bos=False, nfc=True, model_max_length=32768,
    ),
    "llama3": _Family(
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
        markup=(),
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", prepend_bos=True, nfc=False,
        model_max_length=131072,
    ),
}

# Words split off before byte-level BPE: contractions, letter runs with one leading non-letter, numbers in
# groups of up to three digits, punctuation runs, newlines and other whitespace (the GPT-4-era pattern).
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ----------------------------------------------------------------------------------------------- corpus

_WORDS = """the of and to in is was for that on with as by at from it his her they this be are were had not
have but one which an all their there been has when who will more no if out so said what up its about into
than them can only other new some could time these two may then do first any my now such like our over man
me even most made after also did many before must through back years where much your way well down should
because each just those people how too little state good very make world still own see men work long get here
between both life being under never day same another know while last might us great old year off come since
against go came right used take three small place home water house light river city table garden morning
evening window letter paper market school road bridge train station music story question answer reason number
system program data file server request model token cache memory queue network value result error message
open close write read send build start stop find keep hold turn show try call ask need feel become leave put
mean let begin seem help talk change move play run live believe bring happen provide sit stand lose pay meet
include continue set learn lead understand watch follow create speak allow add spend grow offer remember love
consider appear buy wait serve die expect stay fall cut reach kill remain suggest raise pass sell require
report decide pull quickly slowly quietly often always rarely nearly almost together already however perhaps
beautiful simple careful bright dark heavy quiet early late strong clear ready small large green blue""".split()

_NAMES = "Alice Bob Carol Dmitri Elena Farid Grace Hiro Ingrid Jonas Kofi Lena Mateo Nadia Oskar Priya".split()

# Syllables for invented words, so the corpus has far more distinct words than the list above.
_ONSETS = "b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sc sh sl sp st str t th tr v w wh z".split()
_VOWELS = "a e i o u ai ea ee ie oa ou oo y".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "t", "nd", "nt", "st", "ng", "ck", "rd", "m", "x", "ss", "th"]
_SUFFIXES = ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "able", "ment", "ous"]

# A fixed multilingual and technical sample, repeated in the corpus so its byte sequences earn merges.
_SAMPLE = """Le café du coin ouvre à sept heures, même le dimanche. Où est la gare ? Déjà midi !
Die Straßenbahn fährt über die Brücke, während es draußen schneit. Schöne Grüße aus München.
¿Dónde está la estación? Mañana viajaremos al norte con mi hermano. ¡Qué día tan largo!
A canção começou quando as luzes se apagaram. Não há pão, só maçãs e limões.
Сегодня утром мы гуляли по парку и говорили о книгах. Спасибо, до встречи!
Η θάλασσα ήταν ήρεμη όλο το απόγευμα. Καλημέρα σε όλους.
今天天气很好，我们一起去公园散步吧。这个程序可以把文本分成更小的单位。请问最近的地铁站在哪里？
东京的火车站非常大，早上总是很拥挤。我喜欢在晚上读书和写代码。
東京の駅はとても大きくて、朝はいつも混んでいます。新しい本を読み始めました。ありがとうございます。
오늘 저녁에 친구와 함께 영화를 볼 거예요. 감사합니다! 서울은 지금 비가 와요.
ذهبنا إلى السوق لشراء الخبز والفواكه. مرحبا بكم.
मैं हर सुबह चाय पीता हूँ। आज मौसम अच्छा है।
Great job! 🎉🎉 Let's ship it 🚀 — coffee ☕ first. 👍🏽 👨‍👩‍👧 ❤️ 😀😂🤖 ✅ ⚠️
∑ x² ≤ ∞, α + β = γ, 3.14159 ≈ π, 25 °C → 77 °F, naïve façade, coöperate, € 12,50 · £ 9.99 · ¥ 1200
def fetch(url: str, *, retries: int = 3) -> bytes:
    for attempt in range(retries):
        try:
            return http.get(url, timeout=10).content
        except TimeoutError:
            time.sleep(2 ** attempt)
    raise RuntimeError(f"gave up on {url!r}")

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "ok": true, "n": [1, 2, 3]}
$ kubectl get pods -n serving -o wide | grep -v Running
\tif (x != NULL && x->len > 0) { return x->data[0]; }
<html><body class="main"><p>Hello &amp; welcome</p></body></html>
"""


def _word(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return rng.choice(_WORDS)
    syllables = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                        for _ in range(rng.choice((1, 2, 2, 3))))
    return syllables + rng.choice(_SUFFIXES)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 16))]
    if rng.random() < 0.3:
        words[rng.randrange(len(words))] = rng.choice(_NAMES)
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.choice((rng.randint(0, 99), rng.randint(1900, 2030),
                                                                  round(rng.uniform(0, 1000), 2)))))
    if rng.random() < 0.15:
        i = rng.randrange(len(words))
        words[i] = rng.choice(("don't", "it's", "we're", "they've", "I'm", "she'll", "can't"))
    if len(words) > 6 and rng.random() < 0.4:
        words[rng.randrange(1, len(words) - 1)] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".......?!:")


def _corpus(seed: int = 0, sentences: int = 6000) -> Iterator[str]:
    """Training text: seeded English-like paragraphs, every tenth one followed by the fixed sample."""
    rng = random.Random(seed)
    for i in range(0, sentences, 5):
        yield " ".join(_sentence(rng) for _ in range(5)) + rng.choice(("\n", "\n\n", "  \n"))
        if i % 50 == 0:
            yield _SAMPLE


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)


def build_tokenizer(*, vocab_size: int = 4096, template: str = "chatml", seed: int = 0) -> Tokenizer:
    """The trained tokenizer: ``vocab_size`` ids when the corpus yields enough merges, added tokens last."""
    family = _FAMILIES[template]
    n_added = len(family.special) + len(family.markup)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + n_added:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(alphabet)} bytes + {n_added} added tokens")
    tok = Tokenizer(models.BPE())
    if family.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer)
    tok.add_tokens([_added(t, True) for t in family.special] + [_added(t, False) for t in family.markup])
    if family.prepend_bos:
        bos = (family.bos, tok.token_to_id(family.bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos}:1 $B:1", special_tokens=[bos])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(out_dir: Path, *, vocab_size: int = 4096, template: str = "chatml", seed: int = 0) -> dict:
    """Writes tokenizer.json and tokenizer_config.json into ``out_dir``; returns the ids config.json needs.

    ``template`` names both the chat template and its family's special tokens (a key of ``CHAT_TEMPLATES``).
    The result is ``{"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}``; ``bos_token_id`` is
    None for chatml, which has no BOS token (as in Qwen).
    """
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose from {sorted(CHAT_TEMPLATES)}")
    family = _FAMILIES[template]
    tok = build_tokenizer(vocab_size=vocab_size, template=template, seed=seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    config = {
        "added_tokens_decoder": added,
        "bos_token": family.bos,
        "eos_token": family.eos,
        "pad_token": family.pad,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATES[template],
        "clean_up_tokenization_spaces": False,
        "model_max_length": family.model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    ids = {name: tok.token_to_id(token) if token else None
           for name, token in (("bos_token_id", family.bos), ("eos_token_id", family.eos),
                               ("pad_token_id", family.pad))}
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True), **ids}
