"""Every command the operator renders for engine sglang, parsed and resolved by real SGLang.

For the oldest SGLang release the operator supports and the newest it was checked against, each
sample and a matrix over backend, layout, IO backend, write and prefetch policy, tp/dp/pp and page
size is planned (``reconcile.plan``), its pod's args are expanded as the kubelet does (``$(VAR)``
from the container env), and the argv goes through SGLang's own ``prepare_server_args`` and
resolution pipeline. What SGLang resolves must equal the effective config in status: a flag SGLang
would rewrite, refuse or read differently fails here. Two substitutions make it run on CPU: the
model path becomes a local checkpoint of the same kind (SGLang reads its config.json while
resolving) and ``--device cpu`` is appended.
"""

from __future__ import annotations

import json
import pytest
import yaml

from hicache_operator.plan.engine import versions as engine_versions
from hicache_operator.control import pipeline as reconcile
from testbed import sglang_oracle
from tests.unit.operator.op_helpers import SAMPLES, body, gpu_node, sample_nodes

POD_IP = "10.1.2.3"
MAX_TOKENS = 1 << 20


def base(version: str) -> dict:
    return {"engine": "sglang", "image": f"lmsysorg/sglang:v{version}-cu129", "model": "Qwen/Qwen3-8B",
            "maxTotalTokens": 200_000, "hicache": {"hostPool": {"ratio": 2.0}}}


def storage(backend: str) -> dict:
    extra = {"file": {"file_storage_path": "/mnt/l3"},
             "mooncake": {"master_server_address": "mooncake-master:50051"},
             "dynamic": {"backend_name": "mine", "module_path": "my.mod", "class_name": "Store"},
             "none": {}}[backend]
    return {"backend": backend, "extraConfig": extra}


def matrix(version: str) -> list[tuple[str, dict]]:
    """Every value of each dimension once, and the full backend x layout x IO product (where
    SGLang's own rewrites live)."""
    cases = []

    def add(name: str, **over) -> None:
        spec = base(version)
        for key, value in over.items():
            if key == "hicache":
                spec["hicache"].update(value)
            else:
                spec[key] = value
        if spec["hicache"].get("storage", {}).get("backend") == "file":
            spec["extraVolumes"] = [{"name": "l3", "persistentVolumeClaim": {"claimName": "l3"}}]
            spec["extraVolumeMounts"] = [{"name": "l3", "mountPath": "/mnt/l3"}]
        cases.append((name, spec))

    for backend in ("none", "file", "mooncake", "dynamic"):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            for io_backend in ("kernel", "direct"):
                add(f"{backend}-{layout}-{io_backend}",
                    hicache={"storage": storage(backend), "memLayout": layout, "ioBackend": io_backend})
    for policy in ("write_through", "write_through_selective", "write_back"):
        add(f"write-{policy}", hicache={"writePolicy": policy, "allowWriteBack": policy == "write_back",
                                        "storage": storage("file")})
    for policy in ("best_effort", "wait_complete", "timeout"):
        add(f"prefetch-{policy}", hicache={"storage": {**storage("mooncake"), "prefetchPolicy": policy}})
    for tp, dp, pp in ((2, 1, 1), (4, 2, 1), (8, 8, 1), (2, 1, 2)):
        add(f"tp{tp}-dp{dp}-pp{pp}", parallelism={"tp": tp, "dp": dp, "pp": pp},
            hicache={"storage": storage("none" if pp > 1 else "file")})
    add("page-64", pageSize=64, hicache={"storage": storage("mooncake")})
    add("size-per-rank", hicache={"hostPool": {"sizeGBPerRank": 20}})
    add("cache-report", enableCacheReport=True)
    add("extra-args", extraArgs=["--mem-fraction-static", "0.8", "--log-level=debug", "--served-model-name",
                                 "$(POD_NAME)"])
    add("engine-version-field", image="registry.local/sglang:prod", engineVersion=version)
    add("model-source-hugging-face", modelSource={"huggingFace": {"cache": {"claimName": "hf-models"}}})
    add("model-source-pvc", modelSource={"pvc": {"claimName": "models", "path": "qwen3-8b"}})
    add("dollar-in-extra-config", hicache={"storage": {**storage("mooncake"),
                                                       "extraConfig": {"master_server_address": "m:1",
                                                                       "extra_backend_tag": "t$(POD_IP)"}}})
    return cases


def samples() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(SAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "HiCacheDeployment" and doc["spec"].get("engine") == "sglang":
                out.append((path.stem, doc["spec"]))
    return out


class RefusedForVersion(Exception):
    """The operator refuses the spec because the release lacks a feature it uses (never rendered)."""


def rendered(spec: dict) -> tuple[dict, dict, list[str], dict]:
    """(effective config, sizing, argv as the process sees it, container env) for one spec."""
    nodes = sample_nodes() if spec["hicache"].get("hostPool", {}).get("fromNodeMemory") else \
        [gpu_node("gpu-0", memory="2Ti", gpus=8)]
    p = reconcile.plan(body(spec, name="fleet"), nodes)
    if p.desired is None and {f.rule for f in p.outcome.errors} == {"engine-version-feature"}:
        raise RefusedForVersion(p.outcome.errors[0].message)
    assert p.desired is not None, [f.message for f in p.outcome.errors]
    container = p.children[-1]["spec"]["template"]["spec"]["containers"][0]
    sized = p.desired.sizing.dump() if p.desired.sizing is not None else {}
    return (p.desired.effective_config.dump(), sized, sglang_oracle.container_argv(container, POD_IP),
            sglang_oracle.container_env(container, POD_IP))


def expected_extra(effective: dict) -> dict:
    return effective["hicache"]["storage"].get("extraConfig") or {}


def check(name: str, spec: dict, effective: dict, sizing: dict, argv: list[str], env: dict, answer: dict,
          version: str) -> list[str]:
    """Differences between what SGLang resolved and what status says (empty: they agree)."""
    if "error" in answer:
        return [f"{name}: SGLang {version} refused {argv}: {answer['error']}"]
    r, hc = answer["resolved"], effective["hicache"]
    par = {"tp": 1, "dp": 1, "pp": 1, **spec.get("parallelism", {})}
    want = {
        "tp_size": par["tp"], "pp_size": par["pp"], "page_size": spec.get("pageSize", 1),
        "hicache_write_policy": hc["writePolicy"], "hicache_io_backend": hc["ioBackend"],
        "hicache_mem_layout": hc["memLayout"], "enable_cache_report": bool(spec.get("enableCacheReport")),
        "enable_hierarchical_cache": True, "admin_api_key": env["HICACHE_ADMIN_API_KEY"],
        "api_key": env["HICACHE_API_KEY"],
    }
    pool = hc["hostPool"]
    if "ratio" in pool:
        want["hicache_ratio"] = pool["ratio"]
    else:
        want["hicache_size"] = sizing["hicacheSizeGB"]
    if spec.get("maxTotalTokens"):
        want["max_total_tokens"] = spec["maxTotalTokens"]
    if spec.get("modelSource"):  # the path is the source's; clients name the model
        want["served_model_name"] = spec["model"]
    backend = hc["storage"]["backend"]
    if backend != "none":
        want["hicache_storage_backend"] = backend
        want["hicache_storage_prefetch_policy"] = hc["storage"]["prefetchPolicy"]
    diffs = [f"{name}: {k} SGLang {r.get(k)!r} != status {v!r}" for k, v in want.items() if r.get(k) != v]
    if backend == "none" and r.get("hicache_storage_backend") not in (None, "none"):
        diffs.append(f"{name}: SGLang attaches {r['hicache_storage_backend']} with no backend in status")
    if backend != "none":
        raw = r.get("hicache_storage_backend_extra_config")
        got = json.loads(raw) if isinstance(raw, str) else raw
        if got != expected_extra(effective):
            diffs.append(f"{name}: extra config SGLang {got} != status {expected_extra(effective)}")
    if answer["world_size"] != par["tp"] * par["pp"]:
        diffs.append(f"{name}: SGLang runs on {answer['world_size']} GPUs, the pod has {par['tp'] * par['pp']}")
    if par["dp"] > 1:
        groups = r.get("attn_dp_size") if r.get("attn_dp_size", 1) > 1 else r.get("dp_size")
        if groups != par["dp"]:
            diffs.append(f"{name}: attention DP groups SGLang {groups} != status {par['dp']}")
    if answer["server_info_open"]:
        diffs.append(f"{name}: anonymous clients can read /server_info (admin key included)")
    if backend == "file" and answer["file_path"] != expected_extra(effective).get("file_storage_path"):
        diffs.append(f"{name}: SGLang's file backend writes to {answer['file_path']}, status says "
                     f"{expected_extra(effective).get('file_storage_path')}")
    if "headroom" in answer and not all(answer["headroom"]):
        diffs.append(f"{name}: SGLang's host headroom check fails for ranks "
                     f"{[i for i, ok in enumerate(answer['headroom']) if not ok]} with {sizing}")
    return diffs


def run_cases(version: str, cases: list[tuple[str, dict]]) -> list[str]:
    if not sglang_oracle.installed(version):
        pytest.fail(f"sglang {version} is not installed: run scripts/setup.sh (scripts/install-sglang.sh)")
    planned, extra = [], []
    for name, spec in cases:
        try:
            effective, sizing, argv, env = rendered(spec)
        except RefusedForVersion:
            continue
        planned.append((name, spec, effective, sizing, argv, env))
        req = {}
        if sizing.get("podMemoryBytes") and engine_versions.has(version, "host_pool_headroom_check"):
            req.update(pool_bytes=sizing["hostPoolBytesPerRank"], limit=sizing["podMemoryBytes"],
                       usage=sizing["overheadBytes"] + sizing["shmBytes"] + sizing.get("mooncakeSegmentBytes", 0))
        extra.append(req)
    assert planned, "no case renders for this release"
    answers = sglang_oracle.resolve(version, [p[4] for p in planned], extra)
    diffs = []
    for (name, spec, effective, sizing, argv, env), answer in zip(planned, answers):
        diffs += check(name, spec, effective, sizing, argv, env, answer, version)
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize("version", engine_versions.ORACLE_VERSIONS)
def test_matrix_resolves_as_status_says(version):
    diffs = run_cases(version, matrix(version))
    assert not diffs, "\n".join(diffs)


@pytest.mark.slow
def test_samples_resolve_as_status_says():
    """Each sglang sample, on the release its image tag names (one the tests have installed)."""
    by_version: dict[str, list] = {}
    for name, spec in samples():
        version = engine_versions.version_from_image(spec["image"])
        assert version in engine_versions.ORACLE_VERSIONS, f"{name}: image {spec['image']} is not a checked release"
        by_version.setdefault(version, []).append((name, spec))
    assert by_version, "no sglang sample"
    diffs = [d for version, cases in by_version.items() for d in run_cases(version, cases)]
    assert not diffs, "\n".join(diffs)
