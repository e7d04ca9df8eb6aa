"""Integrity trailer of every page this runtime writes, so damage reads as a miss, never as wrong KV.

The file backend appends it to each page file; the Mooncake backend stores it as the page's
``_crc`` object (``mooncake_backend.py``).

Layout (16 bytes, little-endian) after the raw page bytes::

    b"HCP1" | payload length (u64) | CRC-32 (u32)

Why a *trailer* and not a header: the payload stays at offset 0, so SGLang's own
``HiCacheFile`` (which ``readinto``s exactly the page size from the start of the file) still
reads our files byte-exactly; only the integrity check is ours. SGLang's own page files carry
no trailer; ``file_backend.py`` says how those are checked.

Why CRC-32: it is what zlib ships in the standard library, runs at GB/s (no extra dependency),
detects every single-bit flip and every burst up to 32 bits, and misses random damage with
probability 2**-32. It guards against disk/FS damage, not an adversary (anyone who can write the
storage dir can write pages). The CRC is seeded with the file's key name, so a page that ends up
under another key's name (a bad copy or rename) also fails the check. The length field catches
truncation and appended garbage without reading the payload, which is what ``exists`` checks.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"HCP1"
_LAYOUT = struct.Struct("<4sQI")
TRAILER_SIZE = _LAYOUT.size


def _crc(name: str, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(name.encode()))


def make_trailer(name: str, payload) -> bytes:
    """``payload``: any buffer (bytes, memoryview, numpy array) holding the page bytes."""
    return _LAYOUT.pack(MAGIC, len(memoryview(payload).cast("B")), _crc(name, payload))


def has_magic(trailer: bytes) -> bool:
    """The last bytes of a file start like one of our trailers (bare pages almost never do: 2**-32)."""
    return trailer[:4] == MAGIC


def payload_length(trailer: bytes, file_size: int) -> int | None:
    """Page length promised by a trailer, or None if the trailer or the file size is off."""
    if len(trailer) != TRAILER_SIZE:
        return None
    magic, length, _ = _LAYOUT.unpack(trailer)
    if magic != MAGIC or length + TRAILER_SIZE != file_size:
        return None
    return length


def verify(trailer: bytes, name: str, payload) -> bool:
    if len(trailer) != TRAILER_SIZE:
        return False
    magic, length, crc = _LAYOUT.unpack(trailer)
    return magic == MAGIC and length == len(memoryview(payload).cast("B")) and crc == _crc(name, payload)
