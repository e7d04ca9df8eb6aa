"""SGLang's L3 page keys, byte for byte, so pages written by SGLang and by this runtime are interchangeable.

A page's key is the SHA-256 hex digest of the previous page's digest (raw bytes, i.e.
``bytes.fromhex(prior_hash)``) followed by the page's token ids, each a 4-byte little-endian
unsigned int (``get_hash_str`` in SGLang's ``mem_cache/utils.py``, computed by its native
``hash_binding.cpp``). A page holding a token id above 2**32-1 is hashed instead as the prior
digest, one ``0xff`` byte, then every token as an 8-byte little-endian int: the odd byte count
keeps the two encodings apart. EAGLE bigram tokens (tuples) contribute each element. Each page
chains from the previous one, so a key names a whole prefix, not just one page.

The first page of a request that names a cache namespace (``extra_key`` and/or ``cache_salt``)
chains from :func:`namespace_seed` instead of from nothing (SGLang's
``storage_namespace_seed``), so tenants with different salts never share an L3 page, while
requests without either keep the unseeded keys every engine version agrees on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_U32_MAX = 2**32 - 1
_I64_MAX = 2**63 - 1
_NAMESPACE_TAG = b"sglang-cache-namespace-v1"


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """Prior digest of a namespace's first page, or None when the request names no namespace.

    SHA-256 of a fixed tag, then for ``extra_key`` and ``cache_salt`` in that order either
    ``0x00`` (absent) or ``0x01`` + UTF-8 length (u64 LE) + UTF-8 bytes, so absent, empty and
    differently split strings all give different seeds.
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


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
    for t in flat:
        if not isinstance(t, int) or not 0 <= t <= _I64_MAX:
            raise ValueError(f"token ids must be integers in [0, 2**63), got {t!r}")
    if any(t > _U32_MAX for t in flat):
        hasher.update(b"\xff" + struct.pack(f"<{len(flat)}Q", *flat))
    else:
        hasher.update(struct.pack(f"<{len(flat)}I", *flat))
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
