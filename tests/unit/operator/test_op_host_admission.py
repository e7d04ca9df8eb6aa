"""The pod memory limits the operator renders against the real SGLang host-pool admission check.

For each installed release with the check, a child process runs that release's own
``host_memory_budget_bytes`` (its cgroup reading included: ``_cgroup_memory_headroom`` over a
cgroup v2 tree written here, with memory.max at the pod's limit and memory.current / memory.stat
as each rank finds them) and each rank's pool must be at most the budget it gets, the condition
under which SGLang allocates it instead of raising "Not enough host memory available". Rank k finds
the processes' memory (the sized terms, plus what they hold beyond overheadGiB), its k peers' pools,
and the checkpoint the ranks have read in the page cache (counted as used by 0.5.21, as free later).
"""

from __future__ import annotations

import pytest

from hicache_operator.plan.engine import versions as engine_versions
from hicache_operator.api.status import SizingRecord
from hicache_operator.plan import sizing
from hicache_operator.api.spec import HiCacheDeploymentSpec
from testbed import sglang_oracle

from op_helpers import gpu_node

GIB = 2**30
LLAMA_8B_CHECKPOINT = 16_060_556_376  # meta-llama/Llama-3.1-8B-Instruct, its four safetensors shards

CHILD = r"""
import functools, json, sys, tempfile, types
from pathlib import Path
from testbed.sglang_child import stand_in_transfer_kernels
stand_in_transfer_kernels()
from sglang.srt.mem_cache import host_memory
from sglang.srt.mem_cache.pool_host import base

real_headroom = host_memory._cgroup_memory_headroom
host_memory.psutil = types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(available=1 << 50))
out = []
for case in json.load(sys.stdin)["cases"]:
    budgets = []
    for k in range(case["ranks"]):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "proc/self").mkdir(parents=True)
            (root / "proc/self/cgroup").write_text("0::/kubepods/pod-1/runtime\n")
            (root / "proc/self/mountinfo").write_text(
                f"30 25 0:26 / {root}/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n")
            ctr = root / "cgroup/kubepods/pod-1/runtime"
            ctr.mkdir(parents=True)
            cache = case["page_cache"]
            (ctr / "memory.max").write_text(f"{case['limit']}\n")
            (ctr / "memory.high").write_text("max\n")
            (ctr / "memory.current").write_text(f"{case['processes'] + k * case['pool'] + cache}\n")
            (ctr / "memory.stat").write_text(
                f"anon {case['processes'] + k * case['pool']}\nfile {cache}\n"
                f"active_file {cache // 2}\ninactive_file {cache - cache // 2}\nshmem 0\n")
            (ctr / "memory.min").write_text("0\n")
            host_memory._cgroup_memory_headroom = functools.partial(real_headroom, proc_root=root / "proc")
            base.ranks_per_host = lambda: case["ranks"]
            budgets.append(base.host_memory_budget_bytes(case["pool"]))
    out.append(budgets)
print(json.dumps(out))
"""

VERSIONS = [v for v in engine_versions.ORACLE_VERSIONS if engine_versions.has(v, "host_pool_headroom_check")]


def mooncake_sample(version: str) -> dict:
    """manifests/samples/sglang-mooncake.yaml's sizing terms, on ``version``."""
    return {"image": f"lmsysorg/sglang:v{version}", "engine": "sglang", "model": "meta-llama/Llama-3.1-8B-Instruct",
            "parallelism": {"tp": 8}, "pageSize": 64,
            "hicache": {"hostPool": {"sizeGBPerRank": 24, "overheadGiB": 32}, "memLayout": "page_first",
                        "storage": {"backend": "mooncake", "extraConfig": {"global_segment_size": "64gb",
                                                                             "master_server_address": "m:50051"}}}}


def node_sized(version: str) -> dict:
    return {"image": f"lmsysorg/sglang:v{version}", "engine": "sglang", "model": "meta-llama/Llama-3.1-8B-Instruct",
            "parallelism": {"tp": 4}, "pageSize": 32,
            "hicache": {"hostPool": {"fromNodeMemory": {"fraction": 0.8, "reserveGiB": 16}, "overheadGiB": 6}}}


def admission(version: str, records: list[SizingRecord], extras: list[int]) -> list[list[int]]:
    """SGLang ``version``'s budget for each rank of each record's pod, its processes holding ``extra``
    bytes beyond the sized terms and the Llama checkpoint in the page cache."""
    cases = []
    for rec, extra in zip(records, extras):
        processes = (rec.overhead_bytes + rec.shm_bytes + (rec.mooncake_segment_bytes or 0)
                     + (rec.mooncake_local_buffer_bytes or 0) + extra)
        cases.append({"ranks": rec.ranks_per_pod, "pool": rec.host_pool_bytes_per_rank,
                      "limit": sizing.request_bytes(rec.pod_memory_bytes), "processes": processes,
                      "page_cache": LLAMA_8B_CHECKPOINT})
    return sglang_oracle.run(version, CHILD, {"cases": cases})


@pytest.fixture(scope="module", params=VERSIONS)
def version(request):
    if not sglang_oracle.installed(request.param):
        pytest.fail(f"sglang {request.param} is not installed: run scripts/install-sglang.sh")
    return request.param


def test_every_rank_is_admitted_with_slack_and_the_checkpoint_cached(version):
    records = [sizing.compute(HiCacheDeploymentSpec.model_validate(s), [gpu_node("a", "1Ti")])
               for s in (mooncake_sample(version), node_sized(version))]
    # the processes hold 1 GiB more than sized, then up to the whole slack (1 GiB per rank), then beyond it
    extras = [GIB, GIB]
    extras += [r.admission_slack_bytes - 2**20 for r in records]
    extras += [r.admission_slack_bytes + 2 * GIB for r in records]
    budgets = admission(version, records * 3, extras)
    for rec, extra, got in zip(records * 3, extras, budgets):
        pool = rec.host_pool_bytes_per_rank
        admitted = [pool <= b for b in got]
        if extra <= rec.admission_slack_bytes:
            assert all(admitted), (version, rec.formula, extra, [b - pool for b in got])
        else:  # the slack is what it says: beyond it the last rank is refused
            assert admitted[0] and not admitted[-1], (version, extra, [b - pool for b in got])


def test_status_shows_each_term_of_the_check(version):
    rec = sizing.compute(HiCacheDeploymentSpec.model_validate(mooncake_sample(version)), [gpu_node("a", "1Ti")])
    counts_cache = not engine_versions.has(version, "host_headroom_page_cache_free")
    assert rec.page_cache_bytes == (15 * GIB if counts_cache else None)
    assert rec.admission_slack_bytes == 8 * GIB and rec.engine_reserve_bytes == 10 * GIB
    assert rec.engine_headroom_spare_bytes >= GIB
    terms = (rec.overhead_bytes + rec.shm_bytes + rec.mooncake_segment_bytes + rec.mooncake_local_buffer_bytes
             + rec.engine_reserve_bytes + (rec.page_cache_bytes or 0) + rec.admission_slack_bytes)
    assert rec.pod_memory_bytes == terms + 15 * rec.host_pool_bytes_per_rank
    for term in ("(engineReserve)", "(admissionSlack)", "15 x "):
        assert term in rec.formula
    assert ("(pageCache)" in rec.formula) is counts_cache
    assert f"= {rec.host_pool_bytes_per_rank} B pool + {rec.engine_headroom_spare_bytes} B spare" in \
        rec.engine_headroom_check


def test_releases_without_the_check_get_no_slack_or_page_cache():
    spec = HiCacheDeploymentSpec.model_validate(mooncake_sample("0.5.20"))
    rec = sizing.compute(spec, [gpu_node("a", "1Ti")])
    assert (rec.engine_reserve_bytes, rec.page_cache_bytes, rec.admission_slack_bytes) == (0, None, None)
    assert rec.pool_multiplier == 8 and rec.engine_headroom_check is None


def test_the_release_is_a_sizing_input():
    a, b = (HiCacheDeploymentSpec.model_validate(mooncake_sample(v)) for v in ("0.5.21", "0.5.23"))
    assert sizing.inputs_hash(a) != sizing.inputs_hash(b)


def test_a_checkpoint_of_unknown_size_is_warned_about_where_the_release_counts_its_page_cache():
    from hicache_operator.plan.validation import validate

    def run(version):
        raw = {**node_sized(version), "model": "org/custom",
               "modelShape": {"numLayers": 32, "numKvHeads": 8, "headDim": 128}}
        raw["hicache"] = {"hostPool": {"sizeGBPerRank": 8}}
        return [f for f in validate(raw, name="demo", nodes=[gpu_node("a", "1Ti")]).findings
                if f.rule == "engine-page-cache-unknown"]

    warned = run("0.5.21")
    assert len(warned) == 1 and "org/custom" in warned[0].message and "SGLang 0.5.22 or newer" in warned[0].message
    assert run("0.5.23") == []
