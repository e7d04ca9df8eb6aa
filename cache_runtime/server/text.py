"""A request's output as text: what the client sees of the output ids, stop-string trimming, and
the growing text of a stream (``TextStream``), which never takes back what it emitted."""

from __future__ import annotations

from cache_runtime.engine.requests import Output
from cache_runtime.tokenization import Tokenizer


def shown_ids(out: Output) -> list[int]:
    """The output ids whose text the client gets: as in SGLang, a matched stop token (EOS or one of
    stop_token_ids) ends the output without appearing in it; output_ids and usage still count it."""
    ids = out.output_ids
    if out.finished and isinstance((out.finish_reason or {}).get("matched"), int) and ids:
        return ids[:-1]
    return ids


def cut_at_stop(text: str, out: Output) -> str:
    """The text before the first occurrence of the stop string the request matched (SGLang's trim)."""
    matched = (out.finish_reason or {}).get("matched")
    if isinstance(matched, str) and matched and (pos := text.find(matched)) != -1:
        return text[:pos]
    return text


def finish_fields(out: Output) -> dict:
    """OpenAI's finish_reason ("stop", "length", SGLang's "abort") and SGLang's matched_stop (the stop
    string or token id that ended the output)."""
    reason = out.finish_reason if out.finished else None
    return {"finish_reason": reason["type"] if reason else None, "matched_stop": (reason or {}).get("matched")}


class TextStream:
    """A request's output text as it grows, for streaming.

    New ids go through the tokenizer's incremental decoder, and a tail that could still grow into a
    stop string is held back, so emitted text is never cut afterwards: the pieces join to the
    non-streamed text of the same output.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool) -> None:
        self._decoder = tokenizer.decoder(skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._fed = 0
        self._decoded = ""
        self.text = ""  # emitted so far

    def update(self, out: Output) -> str:
        """The text to emit for this output (possibly empty)."""
        ids = shown_ids(out)
        self._decoded += self._decoder.feed(ids[self._fed:])
        self._fed = len(ids)
        if out.finished:
            self._decoded = cut_at_stop(self._decoded + self._decoder.flush(), out)
            end = len(self._decoded)
        else:
            end = len(self._decoded) - self._held()
        delta = self._decoded[len(self.text):max(end, len(self.text))]
        self.text += delta
        return delta

    def _held(self) -> int:
        """The length of the longest tail of the decoded text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._decoded)), best, -1):
                if self._decoded.endswith(s[:k]):
                    best = k
                    break
        return best


def final_text(tokenizer: Tokenizer, out: Output, skip_special_tokens: bool) -> str:
    """The whole text of a finished output."""
    return cut_at_stop(tokenizer.decode(shown_ids(out), skip_special_tokens=skip_special_tokens), out)
