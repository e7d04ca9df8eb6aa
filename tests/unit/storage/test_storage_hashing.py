import hashlib

import pytest
from hypothesis import given, strategies as st

from cache_runtime.storage.hashing import get_hash_str, namespace_seed, page_hashes


def sglang_reference(tokens, prior=None):
    """SGLang's byte layout, written out independently: prior digest bytes, then each token as 4-byte LE uint."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    for t in tokens:
        h.update(t.to_bytes(4, byteorder="little", signed=False))
    return h.hexdigest()


def test_known_vector_first_page():
    # sha256 of 01000000 02000000 03000000
    assert get_hash_str([1, 2, 3]) == "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d"
    assert get_hash_str([1, 2, 3]) == sglang_reference([1, 2, 3])


def test_chained_vector_uses_prior_digest_bytes():
    first = get_hash_str([1, 2, 3])
    manual = hashlib.sha256(bytes.fromhex(first) + bytes([4, 0, 0, 0, 5, 0, 0, 0, 6, 0, 0, 0])).hexdigest()
    assert get_hash_str([4, 5, 6], first) == manual
    assert manual != get_hash_str([4, 5, 6])  # the prior really participates


def test_large_token_ids_are_little_endian_uint32():
    assert get_hash_str([2**32 - 1, 256]) == hashlib.sha256(b"\xff\xff\xff\xff\x00\x01\x00\x00").hexdigest()


def test_bigram_tuples_hash_each_element():
    assert get_hash_str([(1, 2), (3, 4)]) == get_hash_str([1, 2, 3, 4])


def test_a_page_with_a_token_above_u32_is_hashed_wide():
    """SGLang's native hash: prior digest, a 0xff byte, then every token of the page as 8-byte LE."""
    prior = get_hash_str([1])
    expected = hashlib.sha256(bytes.fromhex(prior) + b"\xff" + (2**32).to_bytes(8, "little")
                              + (7).to_bytes(8, "little")).hexdigest()
    assert get_hash_str([2**32, 7], prior) == expected
    assert page_hashes([1, 2, 2**40, 3], 2) == [get_hash_str([1, 2]), get_hash_str([2**40, 3], get_hash_str([1, 2]))]


@pytest.mark.parametrize("bad", [[-1], [2**63], [1.5]])
def test_out_of_range_tokens_are_rejected(bad):
    with pytest.raises(ValueError):
        get_hash_str(bad)


def test_bad_prior_hash_is_rejected():
    with pytest.raises(ValueError, match="hex"):
        get_hash_str([1], "not-hex")


def test_page_hashes_full_pages_only_and_chained():
    tokens = list(range(10))
    keys = page_hashes(tokens, 4)
    assert len(keys) == 2  # the trailing 2 tokens are not a page
    assert keys[0] == sglang_reference(tokens[0:4])
    assert keys[1] == sglang_reference(tokens[4:8], keys[0])
    assert page_hashes(tokens[4:8], 4, prior_hash=keys[0]) == [keys[1]]
    assert page_hashes(tokens[:3], 4) == []
    with pytest.raises(ValueError):
        page_hashes(tokens, 0)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=64), st.one_of(st.none(), st.binary(min_size=32, max_size=32)))
def test_matches_reference_for_any_tokens(tokens, prior):
    prior_hex = prior.hex() if prior else None
    assert get_hash_str(tokens, prior_hex) == sglang_reference(tokens, prior_hex)


def test_namespace_seed_layout():
    """sha256(tag, then per part 0x00 if absent else 0x01 + u64 LE byte length + UTF-8), in SGLang's order."""
    def ref(extra_key, cache_salt):
        h = hashlib.sha256(b"sglang-cache-namespace-v1")
        for part in (extra_key, cache_salt):
            h.update(b"\x00" if part is None else
                     b"\x01" + len(part.encode()).to_bytes(8, "little") + part.encode())
        return h.hexdigest()

    assert namespace_seed(None, None) is None
    for extra_key, cache_salt in [(None, "s"), ("s", None), ("", None), (None, ""), ("a", "b"), ("ab", ""),
                                  ("a", "b\u00e9")]:
        assert namespace_seed(extra_key, cache_salt) == ref(extra_key, cache_salt)
    seeds = {namespace_seed(*ns) for ns in [(None, "s"), ("s", None), ("", "s"), ("ab", ""), ("a", "b")]}
    assert len(seeds) == 5  # which field, absence and the split point all change the seed
