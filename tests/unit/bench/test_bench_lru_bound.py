"""The offline LRU bound bench/multiturn.py reports next to measured hit rates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("multiturn", Path(__file__).resolve().parents[3] / "bench" / "multiturn.py")
multiturn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multiturn)


def req(t_send, t_done, ids, out):
    return {"t_send": t_send, "t_done": t_done, "input_ids": ids, "output_ids": out}


def test_repeat_prefix_hits_whole_pages_but_never_the_last_prompt_token():
    ids = list(range(9))  # 2 full pages of 4 + 1 token
    reqs = [req(0, 1, ids, [100, 101]), req(2, 3, ids + [200, 201, 202], [7])]
    # First: cold. The first request leaves 9 + 1 KV tokens (its last output token is never fed
    # back): 2 full pages, which is what the second request finds.
    assert multiturn.lru_hits(reqs, capacity_tokens=1000, page_size=4) == [0, 8]


def test_capacity_evicts_least_recently_used_prefixes():
    a, b = list(range(0, 9)), list(range(50, 59))
    reqs = [req(0, 1, a, [1]), req(2, 3, b, [1]), req(4, 5, a, [1]), req(6, 7, b, [1])]
    # Room for 2 pages only: each conversation evicts the other's pages.
    assert multiturn.lru_hits(reqs, capacity_tokens=8, page_size=4) == [0, 0, 0, 0]
    # Room for both: every repeat hits its 2 full pages.
    assert multiturn.lru_hits(reqs, capacity_tokens=16, page_size=4) == [0, 0, 8, 8]


def test_in_flight_requests_do_not_see_each_other():
    ids = list(range(9))
    reqs = [req(0, 5, ids, [1]), req(1, 6, ids, [1])]  # the second is sent before the first returns
    assert multiturn.lru_hits(reqs, capacity_tokens=1000, page_size=4) == [0, 0]
