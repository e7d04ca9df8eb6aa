"""The engine feature table (hicache_operator.plan.engine.versions) against the real SGLang releases.

For each release in ORACLE_VERSIONS a child process imports that release and probes each feature
in the table the way a pod would meet it: its own argument parser for flags, choices and
defaults; its ``prepare_server_args`` + resolution for attention DP; the routes and auth levels
declared in its http_server.py (read with ``ast``: the module needs CUDA kernels to import) and its
``decide_request_auth``; its Mooncake config loader with MOONCAKE_LOCAL_HOSTNAME set; its file
backend's directory choice; its host-pool budget with a faked cgroup headroom. Each feature must be
present exactly when ``engine_versions.has`` says so.
"""

from __future__ import annotations

import pytest

from hicache_operator.plan.engine import versions as ev
from hicache_operator.api import flags
from testbed import sglang_oracle

# Runs inside the child (sglang_oracle.run): reads the request on stdin, prints one JSON line.
PROBE = r'''
import argparse, ast, contextlib, dataclasses, inspect, io, json, os, sys, types
from pathlib import Path

req = json.loads(sys.stdin.read())
model = req["model"]
out = {}


from testbed.sglang_child import resolve_args as resolve, stand_in_transfer_kernels


with contextlib.redirect_stdout(io.StringIO()):
    import sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    opts = {s: a for a in parser._actions for s in a.option_strings}
    out["flags"] = {f: f in opts for f in req["flags"]}
    out["choices"] = {f: {c: f in opts and c in (opts[f].choices or ()) for c in cs}
                      for f, cs in req["choices"].items()}

    def parse(extra):
        try:
            return vars(parser.parse_args(["--model-path", model] + extra))
        except SystemExit:
            return None

    ns = parse([])
    out["defaults"] = {"mem_layout": ns["hicache_mem_layout"], "prefetch_policy": ns["hicache_storage_prefetch_policy"]}
    ns = parse(["--admin-api-key", "x"])
    out["admin_api_key_parsed"] = ns is not None and ns.get("admin_api_key") == "x"

    # Attention DP / replicas as SGLang resolves them.
    out["dp"] = {}
    for name, extra in req["dp_cases"].items():
        try:
            _, r = resolve(["--model-path", model, "--device", "cpu"] + extra)
            keys = ("tp_size", "pp_size", "dp_size", "attn_dp_size", "enable_dp_attention")
            out["dp"][name] = {k: r.get(k) for k in keys}
        except BaseException as exc:
            out["dp"][name] = {"error": f"{type(exc).__name__}: {exc}"}

    # Routes declared in http_server.py: "METHOD /path" -> auth level.
    src = Path(sglang.__file__).parent / "srt" / "entrypoints" / "http_server.py"
    routes = {}
    for node in ast.walk(ast.parse(src.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        level, found = "normal", []
        for d in node.decorator_list:
            if not isinstance(d, ast.Call):
                continue
            f = d.func
            if isinstance(f, ast.Name) and f.id == "auth_level":
                level = d.args[0].attr.lower()
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "app" \
                    and d.args and isinstance(d.args[0], ast.Constant):
                if f.attr == "api_route":
                    methods = [e.value for kw in d.keywords if kw.arg == "methods" for e in kw.value.elts]
                elif f.attr in ("get", "post", "put", "delete", "patch"):
                    methods = [f.attr.upper()]
                else:
                    continue
                found += [f"{m} {d.args[0].value}" for m in methods]
        for r in found:
            routes[r] = level
    out["routes"] = {r: routes.get(r) for r in req["routes"]}

    from sglang.srt.utils import auth
    out["server_info_anonymous"] = auth.decide_request_auth(
        method="GET", path="/server_info", authorization_header=None, api_key=None, admin_api_key="k",
        auth_level=auth.AuthLevel(routes.get("GET /server_info", "normal"))).allowed
    args, _ = resolve(["--model-path", model, "--device", "cpu", "--admin-api-key", "k"])
    try:
        from sglang.srt.utils.common import build_server_info
    except ImportError:  # /server_info builds the body inline: resolved_dict() (0.5.2x) or asdict (older)
        info = args.resolved_dict() if hasattr(args, "resolved_dict") else dataclasses.asdict(args)
    else:
        info = build_server_info(args, {})
        try:
            from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
            info = redact_watermark_secrets(info)
        except ImportError:
            pass
    out["server_info_admin_key"] = info.get("admin_api_key")

    import sglang.srt.mem_cache.memory_pool
    stand_in_transfer_kernels()

    from sglang.srt.mem_cache.storage.mooncake_store import mooncake_store as ms
    load = ms.MooncakeStoreConfig.load_from_extra_config
    master = {"master_server_address": "mooncake-master:50051"}
    os.environ.pop("LOCAL_HOSTNAME", None)
    os.environ["MOONCAKE_LOCAL_HOSTNAME"] = "10.0.0.7"
    out["mooncake"] = {"env_and_key": load({**master, "local_hostname": "10.9.9.9"}).local_hostname,
                       "env_only": load(master).local_hostname}
    del os.environ["MOONCAKE_LOCAL_HOSTNAME"]
    out["mooncake"].update(key_only=load({**master, "local_hostname": "10.9.9.9"}).local_hostname,
                           neither=load(master).local_hostname)

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    params = inspect.signature(HiCacheStorageConfig).parameters
    cfg = {k: v for k, v in dict(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                 is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                 model_name="m").items() if k in params}
    env = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"

    def file_path(extra, env_dir=None):
        os.environ.pop(env, None)
        if env_dir:
            os.environ[env] = env_dir
        try:
            return HiCacheFile(HiCacheStorageConfig(**cfg, extra_config=extra)).file_path  # rank 1: no mkdir
        finally:
            os.environ.pop(env, None)

    out["file"] = {"key": file_path({"file_storage_path": "/mnt/l3"}), "no_key": file_path({}),
                   "env_and_key": file_path({"file_storage_path": "/mnt/l3"}, "/env/dir"),
                   "default": inspect.signature(HiCacheFile.__init__).parameters["file_path"].default}

    try:
        from sglang.srt.mem_cache import host_memory
        from sglang.srt.mem_cache.pool_host import base as pool_base
        pool_base.host_memory_budget_bytes
    except (ImportError, AttributeError):
        out["headroom"] = None
    else:
        # A cgroup v2 container at 100 GiB limit, 60 GiB used, of which 16 GiB page cache.
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "proc/self").mkdir(parents=True)
            (root / "proc/self/cgroup").write_text("0::/ctr\n")
            (root / "proc/self/mountinfo").write_text(f"30 25 0:26 / {root}/cg rw - cgroup2 cgroup2 rw\n")
            (root / "cg/ctr").mkdir(parents=True)
            for name, value in {"memory.max": 100 << 30, "memory.high": "max", "memory.current": 60 << 30,
                                "memory.stat": "anon 47244640256\nactive_file 8589934592\ninactive_file 8589934592"}.items():
                (root / "cg/ctr" / name).write_text(f"{value}\n")
            out["page_cache_headroom"] = host_memory._cgroup_memory_headroom(proc_root=root / "proc")
        host_memory.psutil = types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(available=1 << 50))
        host_memory._cgroup_memory_headroom = lambda *a, **k: 50 << 30
        pool_base.ranks_per_host = lambda: 4
        out["headroom"] = {"reserve": pool_base.HICACHE_HOST_MEMORY_RESERVE_BYTES,
                           "budget": pool_base.host_memory_budget_bytes()}

print(json.dumps(out))
'''

STORAGE_ROUTES = ("PUT /hicache/storage-backend", "DELETE /hicache/storage-backend", "GET /hicache/storage-backend")
INFO_ROUTES = ("GET /server_info", "GET /get_server_info")
LEGACY_DP = ["--enable-dp-attention", "--dp-size", "2"]
DP_CASES = {"attn_flag": ["--tp-size", "4", "--attn-dp-size", "2"],
            "legacy": ["--tp-size", "4"] + LEGACY_DP,
            "replicas": ["--tp-size", "4", "--dp-size", "2"]}

# Flags / choices the operator renders that have their own row in the table.
FLAG_FEATURE = {"--admin-api-key": "admin_api_key", "--attn-dp-size": "attn_dp_size_flag",
                "--hicache-storage-backend-extra-config": "extra_config_flag"}
CHOICE_FEATURE = {("--hicache-mem-layout", "page_first_direct"): "page_first_direct_layout"}


def rendered_flags() -> list[str]:
    out = [f.cli for f in flags.FLAGS if "sglang" in f.engines]
    out += list(flags.FIXED_ARGS["sglang"]) + ["--host", "--port", "--admin-api-key", "--api-key"]
    out += ["--enable-dp-attention", "--dp-size"]  # the attention-DP spelling before --attn-dp-size
    return sorted(set(out))


def rendered_choices() -> dict[str, list[str]]:
    # backend "none" is rendered by leaving the flag out
    return {f.cli: [c for c in f.choices if c != "none"] for f in flags.FLAGS if f.choices and "sglang" in f.engines}


_cache: dict[str, dict] = {}


def probe(version: str) -> dict:
    if version not in _cache:
        if not sglang_oracle.installed(version):
            pytest.fail(f"sglang {version} is not installed: run scripts/install-sglang.sh")
        request = {"model": str(sglang_oracle.demo_checkpoint()), "flags": rendered_flags(),
                   "choices": rendered_choices(), "routes": list(STORAGE_ROUTES + INFO_ROUTES), "dp_cases": DP_CASES}
        _cache[version] = sglang_oracle.run(version, PROBE, request, timeout=900)
    return _cache[version]


def attention(r: dict) -> tuple[int, int]:
    """(attention DP groups, whole replicas) of resolved args, in either release's spelling."""
    assert "error" not in r, r
    if r.get("attn_dp_size") is not None:
        return r["attn_dp_size"], r["dp_size"]
    legacy = bool(r.get("enable_dp_attention"))
    return (r["dp_size"], 1) if legacy else (1, r["dp_size"])


GiB = 1 << 30
PRESENT = {
    "admin_api_key": lambda o: o["flags"]["--admin-api-key"] and o["admin_api_key_parsed"],
    "storage_attach_api": lambda o: all(o["routes"][r] == "admin_optional" for r in STORAGE_ROUTES),
    "mooncake_hostname_env_with_extra_config": lambda o: o["mooncake"]["env_and_key"] == "10.0.0.7"
    and o["mooncake"]["env_only"] == "10.0.0.7",
    "attn_dp_size_flag": lambda o: o["flags"]["--attn-dp-size"] and attention(o["dp"]["attn_flag"]) == (2, 1),
    "file_storage_path_key": lambda o: o["file"]["key"] == "/mnt/l3",
    "host_pool_headroom_check": lambda o: o["headroom"] is not None and o["headroom"]["reserve"] == 10 * GiB
    and o["headroom"]["budget"] == (50 * GiB - 10 * GiB) // 4,
    "host_headroom_page_cache_free": lambda o: o.get("page_cache_headroom") == 56 * GiB,
    "server_info_exposes_admin_key": lambda o: all(o["routes"][r] == "normal" for r in INFO_ROUTES)
    and o["server_info_anonymous"] and o["server_info_admin_key"] == "k",
    "extra_config_flag": lambda o: o["flags"]["--hicache-storage-backend-extra-config"],
    "page_first_direct_layout": lambda o: o["choices"]["--hicache-mem-layout"]["page_first_direct"],
    "default_prefetch_policy_timeout": lambda o: o["defaults"]["prefetch_policy"] == "timeout",
    "default_mem_layout_page_first": lambda o: o["defaults"]["mem_layout"] == "page_first",
}


def test_every_feature_has_a_probe():
    assert set(PRESENT) == set(ev.FEATURES)


@pytest.mark.slow
@pytest.mark.parametrize("version", ev.ORACLE_VERSIONS)
@pytest.mark.parametrize("feature", sorted(ev.FEATURES))
def test_feature_present_iff_table_says(version, feature):
    assert bool(PRESENT[feature](probe(version))) == ev.has(version, feature), \
        f"sglang {version}: {feature} (table min {ev.FEATURES[feature].min_version})"


@pytest.mark.slow
@pytest.mark.parametrize("version", ev.ORACLE_VERSIONS)
def test_rendered_flags_and_choices(version):
    """Every flag and choice the operator renders exists, except where the table says it does not."""
    o = probe(version)
    for f, present in o["flags"].items():
        want = ev.has(version, FLAG_FEATURE[f]) if f in FLAG_FEATURE else True
        assert present == want, f"sglang {version}: {f}"
    for f, cs in o["choices"].items():
        for c, present in cs.items():
            want = ev.has(version, CHOICE_FEATURE[(f, c)]) if (f, c) in CHOICE_FEATURE else True
            assert present == want, f"sglang {version}: {f} {c}"


@pytest.mark.slow
@pytest.mark.parametrize("version", ev.ORACLE_VERSIONS)
def test_attention_dp_spellings(version):
    """The spelling the operator renders gives 2 attention groups in 1 replica (tp 4 GPUs); the
    legacy spelling keeps working; --dp-size alone means whole replicas (dp x tp GPUs)."""
    o = probe(version)
    spelled = "attn_flag" if ev.has(version, "attn_dp_size_flag") else "legacy"
    assert attention(o["dp"][spelled]) == (2, 1)
    assert attention(o["dp"]["legacy"]) == (2, 1)
    assert attention(o["dp"]["replicas"]) == (1, 2)
    assert all(o["dp"][c]["tp_size"] == 4 and o["dp"][c]["pp_size"] == 1 for c in ("legacy", "replicas"))


@pytest.mark.slow
@pytest.mark.parametrize("version", ev.ORACLE_VERSIONS)
def test_mooncake_hostname_sources(version):
    """Without the env the extra-config local_hostname key is used (the operator's fallback writes
    $(MOONCAKE_LOCAL_HOSTNAME) there); with neither, "localhost"."""
    m = probe(version)["mooncake"]
    assert m["key_only"] == "10.9.9.9"
    assert m["neither"] == "localhost"
    if not ev.has(version, "mooncake_hostname_env_with_extra_config"):
        assert m["env_and_key"] == "10.9.9.9" and m["env_only"] == "localhost"


@pytest.mark.slow
@pytest.mark.parametrize("version", ev.ORACLE_VERSIONS)
def test_file_backend_directory(version):
    """The env var beats the extra-config key in every release; /tmp/hicache otherwise."""
    f = probe(version)["file"]
    assert f["default"] == "/tmp/hicache" and f["no_key"] == "/tmp/hicache"
    assert f["env_and_key"] == "/env/dir"
    if not ev.has(version, "file_storage_path_key"):
        assert f["key"] == "/tmp/hicache"
