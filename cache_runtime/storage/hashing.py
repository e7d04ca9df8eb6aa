"""SGLang's L3 page keys, byte for byte, so pages written by SGLang and by this runtime are interchangeable.

SGLang (``get_hash_str``) hashes, with SHA-256, the previous page's digest (raw bytes, i.e.
``bytes.fromhex(prior_hash)``) followed by every token id as a 4-byte little-endian unsigned
int; EAGLE bigram tokens (tuples) contribute each element. The hex digest is the key, and each
page chains from the previous one, so a key names a whole prefix, not just one page.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def _flat_tokens(token_ids: Sequence) -> list[int]:
    flat: list[int] = []
    for t in token_ids:
        if isinstance(t, tuple):
            flat.extend(t)
        else:
            flat.append(t)
    return flat


def get_hash_str(token_ids: Sequence, prior_hash: str | None = None) -> str:
    hasher = hashlib.sha256()
    if prior_hash:
        try:
            hasher.update(bytes.fromhex(prior_hash))
        except ValueError as exc:
            raise ValueError(f"prior_hash must be a hex digest, got {prior_hash!r}") from exc
    flat = _flat_tokens(token_ids)
    try:
        hasher.update(struct.pack(f"<{len(flat)}I", *flat))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    return hasher.hexdigest()


def page_hashes(token_ids: Sequence, page_size: int, prior_hash: str | None = None) -> list[str]:
    """Chained keys of the full pages of ``token_ids`` (a trailing partial page has no key)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    keys: list[str] = []
    last = prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        last = get_hash_str(token_ids[start : start + page_size], last)
        keys.append(last)
    return keys
