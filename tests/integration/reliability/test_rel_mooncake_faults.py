"""The Mooncake master dies and comes back while the runtime serves.

Requests keep succeeding with correct output while L3 is gone (the engine runs on L1+L2 and
reports ``hicache_storage_degraded 1``); once a master listens on the same address again, the
runtime's recovery probe resumes L3 and pages are stored to and loaded from it again.
"""
from __future__ import annotations

import json
import time

from testbed.mooncake import MooncakeMaster, mooncake_env  # noqa: F401  (fixture)
from testbed.runtime_proc import metric
from tests.integration.reliability.conftest import PROMPTS, generate


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


def test_master_killed_and_restarted_under_load(mooncake_env, start_runtime, reference):
    master = MooncakeMaster().start()
    try:
        extra = {**master.extra_config(), "prefetch_threshold": 4}
        rt = start_runtime("--enable-hierarchical-cache", "--page-size", "4", "--max-total-tokens", "4096",
                           "--hicache-storage-backend", "mooncake", "--hicache-mem-layout", "page_first",
                           "--hicache-storage-prefetch-policy", "wait_complete",
                           "--hicache-storage-backend-extra-config", json.dumps(extra), env=mooncake_env)
        with rt.client() as c:
            generate(c, PROMPTS[20])
            _wait(lambda: metric(c, "sglang:backuped_tokens_total") > 0, 30, "a first backup to L3")

            master.kill()
            for p in PROMPTS[21:27]:  # served on L1+L2 while the store is gone
                assert generate(c, p)["output_ids"] == reference(p)
            _wait(lambda: metric(c, "hicache_storage_degraded") == 1, 30, "L3 marked degraded")
            for p in PROMPTS[27:29]:
                assert generate(c, p)["output_ids"] == reference(p)

            master = MooncakeMaster(rpc_port=master.rpc_port, metrics_port=master.metrics_port,
                                    http_port=master.http_port).start()
            _wait(lambda: metric(c, "hicache_storage_degraded") == 0, 60, "L3 recovered after the restart")

            backed = metric(c, "sglang:backuped_tokens_total")
            fresh = PROMPTS[30]
            generate(c, fresh)
            _wait(lambda: metric(c, "sglang:backuped_tokens_total") > backed, 30, "a backup to the new master")
            assert c.post("/flush_cache?timeout=60").status_code == 200
            out = generate(c, fresh)
            assert out["output_ids"] == reference(fresh)
            assert out["meta_info"]["cached_tokens_details"]["storage"] > 0, out["meta_info"]
    finally:
        master.stop()
