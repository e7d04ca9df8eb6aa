"""extraArgs and env judged by SGLang's own resolution: the tables in ``engine_cli`` against real SGLang.

For every oracle release, a rendered command (``reconcile.plan`` of an sglang spec, expanded as the
kubelet does) goes through SGLang's own ``prepare_server_args`` and resolution, once bare and once
with each extra argument of ``engine_cli.REFUSED_ARGS`` (refused and kept values) and of a sample of
harmless ones. The operator must refuse an extra argument (``validate``: any extraArgs or page-size
finding) exactly when SGLang raises, or resolves an operator-owned setting or the pod's topology
(nodes, node rank, rendezvous, GPU ids) differently from the bare command. ``ENGINE_ENV`` is checked
the same way against SGLang's file backend, which each such variable must move.
"""

from __future__ import annotations

import pytest

from hicache_operator.plan.engine import features as engine, cli as engine_cli, versions as engine_versions
from hicache_operator.plan import validation
from testbed import sglang_oracle
from tests.unit.sglang.test_rendered_commands import base, rendered

# Runs under one release (sglang_oracle.run): the resolved value of each field below, or the error.
CHILD = r'''
import contextlib, inspect, io, json, os, sys
from testbed.sglang_child import FIELDS, resolve_args, stand_in_transfer_kernels

TOPOLOGY = ("nnodes", "node_rank", "dist_init_addr", "base_gpu_id", "gpu_id_step", "dcp_size")
req = json.loads(sys.stdin.read())
out = []
for argv in req["argvs"]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            values = resolve_args(argv)[1]
        out.append({"resolved": {k: values.get(k) for k in FIELDS + TOPOLOGY}})
    except BaseException as exc:
        said = [ln for ln in err.getvalue().splitlines() if "error:" in ln] if isinstance(exc, SystemExit) else []
        out.append({"error": said[-1] if said else f"{type(exc).__name__}: {exc}"})
stand_in_transfer_kernels()
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
paths = {}
for var, value in [("", ""), *req["env"].items()]:  # "": none set
    given = dict(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                 enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
                 extra_config={"file_storage_path": "/mnt/l3"})
    known = inspect.signature(HiCacheStorageConfig).parameters  # the fields differ between releases
    cfg = HiCacheStorageConfig(**{k: v for k, v in given.items() if k in known})
    os.environ.update({var: value} if var else {})
    paths[var] = HiCacheFile(cfg).file_path  # rank 1: never creates the directory
    os.environ.pop(var, None)
out.append(paths)
print(json.dumps(out))
'''

OTHER = {"--nnodes": "2", "--node-rank": "1", "--dist-init-addr": "10.9.9.9:5000", "--base-gpu-id": "1",
         "--gpu-id-step": "2", "--dcp-size": "2"}
HARMLESS = [["--mem-fraction-static", "0.8"], ["--chunked-prefill-size", "4096"], ["--log-level=debug"],
            ["--max-running-requests", "64"], ["--schedule-policy", "lpm"], ["--enable-mixed-chunk"],
            ["--kv-cache-dtype", "fp8_e4m3"], ["--attention-backend", "triton"], ["--ep-size", "2"]]
# Env vars SGLang reads beside the file backend's directory that leave it where status says.
HARMLESS_ENV = {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "100G", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": "/x.json"}


def cases() -> list[list[str]]:
    out = [[r.flag] if not r.keeps and r.flag not in OTHER else [r.flag, OTHER.get(r.flag, "10.9.9.9:5000")]
           for r in engine_cli.REFUSED_ARGS]
    out += [[r.flag, keep] for r in engine_cli.REFUSED_ARGS for keep in r.keeps]
    return out + HARMLESS + [["--attention-backend", "flashmla"]]


def refuses(spec: dict, extra: list[str]) -> list[str]:
    parsed, _ = validation.parse({**spec, "extraArgs": extra})
    return [f.rule for f in validation.check_extra_args(parsed) + validation.check_page_size(parsed, None)]


def ignored(flag: str, version: str) -> bool:
    """The table says this release accepts ``flag`` and ignores it (and the operator refuses it anyway)."""
    r = next((r for r in engine_cli.REFUSED_ARGS if r.flag == flag), None)
    return r is not None and r.ignored_before is not None and \
        engine_versions.parse_version(version) < engine_versions.parse_version(r.ignored_before)


@pytest.mark.slow
@pytest.mark.parametrize("version", engine_versions.ORACLE_VERSIONS)
def test_refused_extra_args_and_env_are_what_sglang_refuses_or_rewrites(version):
    if not sglang_oracle.installed(version):
        pytest.fail(f"sglang {version} is not installed: run scripts/setup.sh (scripts/install-sglang.sh)")
    spec = {**base(version), "parallelism": {"tp": 2}}
    _effective, _sizing, argv, _env = rendered(spec)
    extras = cases()
    argvs = [sglang_oracle.for_cpu(argv + extra) for extra in [[]] + extras]
    env = {**{var: "/elsewhere" for var in engine_cli.ENGINE_ENV}, **HARMLESS_ENV}
    *answers, paths = sglang_oracle.run(version, CHILD, {"argvs": argvs, "env": env}, timeout=900)
    bare = answers[0]["resolved"]
    disagree = []
    for extra, answer in zip(extras, answers[1:]):
        rules = refuses(spec, extra)
        if {"extra-args-unknown-flag", "extra-args-owned-flag"} & set(rules):
            continue  # not this release's flag: its parser refuses it, and so does the operator
        changed = {k: (bare[k], v) for k, v in answer.get("resolved", {}).items() if bare.get(k) != v}
        sglang_refuses = "error" in answer or bool(changed)
        if ignored(extra[0], version) and (sglang_refuses or not rules):
            disagree.append(f"{extra}: the table says SGLang {version} ignores it; it {answer.get('error') or changed}")
        elif bool(rules) != sglang_refuses and not ignored(extra[0], version):
            said = answer.get("error") or changed or "accepts"
            disagree.append(f"{extra}: operator {rules or 'accepts'}, SGLang {said}")
    unset = paths.pop("")
    for var, path in paths.items():
        if (var in engine_cli.ENGINE_ENV) != (path != unset):
            disagree.append(f"env {var}: the file backend writes to {path}")
    assert not disagree, "\n".join(disagree)


# Attention backends SGLang takes without a GPU check at resolution (the others need the GPU kind).
CPU_BACKENDS = ("flashmla", "cutlass_mla", "hpc_ops", "triton", "flashinfer", "fa3")


@pytest.mark.slow
@pytest.mark.parametrize("version", engine_versions.ORACLE_VERSIONS)
def test_page_size_rules_are_sglangs_for_explicit_backends(version):
    """``engine.served_page_size`` (which validation, status and sizing rest on) against SGLang's own
    resolution of the rendered command with each attention backend and page size, on a GPU that
    is neither Hopper nor SM100 (the demo checkpoint is an MHA model)."""
    if not sglang_oracle.installed(version):
        pytest.fail(f"sglang {version} is not installed: run scripts/setup.sh (scripts/install-sglang.sh)")
    combos = [(backend, page) for backend in CPU_BACKENDS for page in (1, 16, 64, 128)]
    argvs = []
    for backend, page in combos:
        _effective, _sizing, argv, _env = rendered({**base(version), "pageSize": page})
        argvs.append(sglang_oracle.for_cpu(argv + ["--attention-backend", backend]))
    *answers, _paths = sglang_oracle.run(version, CHILD, {"argvs": argvs, "env": {}}, timeout=900)
    disagree, checked = [], 0
    for (backend, page), answer in zip(combos, answers):
        if "error" in answer:
            assert "invalid choice" in answer["error"], (backend, page, answer["error"])
            continue  # not a backend of this release
        checked += 1
        ours = engine.served_page_size(version, page, {"attention": backend}, 8, mla=False)
        if answer["resolved"]["page_size"] != ours:
            disagree.append(f"{backend} page {page}: SGLang {answer['resolved']['page_size']}, operator {ours}")
    assert checked and not disagree, "\n".join(disagree)
