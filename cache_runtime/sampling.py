"""Sampling parameters (SGLang's names) and next-token selection."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # greedy unless asked otherwise: outputs are deterministic
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    min_p: float = 0.0

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary (0..{vocab_size - 1})")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """Picks the next token from one row of logits; returns (token, its log-probability under the model)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.temperature == 0:
        tok = int(torch.argmax(logprobs))
        return tok, float(logprobs[tok])
    # In float64 (a tiny temperature is 0 in float32) and shifted so the best score is 0: a tiny
    # temperature then sends the others to -inf instead of every score to inf (softmax NaN).
    scores = logits.double()
    scores = (scores - scores.max()) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.min_p > 0:  # drop tokens less likely than min_p x the most likely one (scores are shifted: max 0)
        scores = scores.masked_fill(scores < torch.log(torch.tensor(params.min_p, dtype=scores.dtype)), float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, -1) > params.top_p
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, -1).cpu()
    tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logprobs[tok])
