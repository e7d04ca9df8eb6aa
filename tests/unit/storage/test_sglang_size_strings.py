"""Size strings read as the real SGLang reads them, release by release.

The file backend's ``max_size`` / ``min_free_space`` (SGLang: ``lru_file_evictor._parse_size_to_bytes``
over ``human_readable_int``) and Mooncake's ``global_segment_size`` (``_parse_global_segment_size``)
are parsed by each installed oracle; the bundled runtime must get the same bytes, and the operator
must refuse at apply time exactly the values SGLang would read as something other than what was
written (no bound, 1 byte, or a failed start), saying what to write instead.
"""

from __future__ import annotations

import pytest

from cache_runtime.storage.file_eviction import parse_size
from cache_runtime.storage.mooncake_config import parse_segment_size
from hicache_operator.plan.engine import versions as engine_versions
from hicache_operator.plan import sizing, validation
from testbed import sglang_oracle

VALUES = ["200G", "200Gi", "500m", "500M", "200g", "10K", "10k", "10Ki", "1Ti", "1.5G", "1.5Gi", "25.6k",
          "200GB", "4gb", "4GB", " 4 gb", "gb", "64", " 1048576 ", "0", "00", "", "-5", "1_000", "abc", "1e9",
          "200 G", "64GiB", 0, 1048576, -1, 1.5e11, 4.7, True, None]

CHILD = r"""
import json, logging, sys
from testbed.sglang_child import stand_in_transfer_kernels
stand_in_transfer_kernels()  # older releases import CUDA kernels with their storage modules
request = json.load(sys.stdin)
try:
    from sglang.srt.mem_cache.storage.file import lru_file_evictor
except ImportError:  # a release without the file backend's evictor
    lru_file_evictor = None
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import _parse_global_segment_size

class Count(logging.Handler):
    n = 0
    def emit(self, record):
        Count.n += 1

if lru_file_evictor is not None:
    logging.getLogger(lru_file_evictor.__name__).addHandler(Count())
out = []
for v in request["values"]:
    row = {}
    if lru_file_evictor is not None:
        Count.n = 0
        row["file"] = lru_file_evictor._parse_size_to_bytes(v)
        row["file_warned"] = Count.n > 0
        if isinstance(v, str):
            try:
                row["file_raw"] = lru_file_evictor.human_readable_int(v.strip())
            except Exception as exc:
                row["file_raw_error"] = type(exc).__name__
    try:
        row["mooncake"] = _parse_global_segment_size(v)
    except Exception as exc:
        row["mooncake_error"] = f"{type(exc).__name__}: {exc}"
    out.append(row)
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=engine_versions.ORACLE_VERSIONS)
def oracle(request):
    version = request.param
    if not sglang_oracle.installed(version):
        pytest.fail(f"sglang {version} is not installed: run scripts/install-sglang.sh")
    return version, dict(zip(map(repr, VALUES), sglang_oracle.run(version, CHILD, {"values": VALUES})))


def test_the_file_backend_size_is_parsed_as_sglang_parses_it(oracle):
    version, answers = oracle
    if "file" not in answers[repr("0")]:
        pytest.skip(f"sglang {version} has no file-backend size bound")
    got = {repr(v): parse_size(v, "max_size") for v in VALUES}
    want = {repr(v): answers[repr(v)]["file"] for v in VALUES}
    assert got == want
    assert (want["'200G'"], want["'1Ti'"], want["'1.5G'"], want["'500m'"]) == (200 * 10**9, 2**40, 1_500_000_000, 0)


def _refused_by_sglang(value, answer) -> bool:
    """SGLang reads ``value`` as something other than the size written: no bound, or 1 byte."""
    if isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return value < 0
    if value is None or value.strip() in ("", "0"):
        return False
    return answer["file_warned"] or "file_raw_error" in answer or answer["file_raw"] < 0


def test_the_operator_refuses_exactly_the_file_sizes_sglang_misreads(oracle):
    version, answers = oracle
    if "file" not in answers[repr("0")]:
        pytest.skip(f"sglang {version} has no file-backend size bound")
    for value in VALUES:
        answer = answers[repr(value)]
        refused = validation.file_size_problem(value) is not None
        assert refused == _refused_by_sglang(value, answer), (value, answer)
        if answer["file_warned"]:  # SGLang only logs: these are what silently lose the bound
            assert refused, value


def test_the_mooncake_segment_size_is_parsed_as_sglang_parses_it(oracle):
    version, answers = oracle
    for value in VALUES:
        answer = answers[repr(value)]
        usable = "mooncake" in answer and not isinstance(value, bool) and answer["mooncake"] >= 0
        if usable:
            assert parse_segment_size(value) == answer["mooncake"], value
            assert sizing.segment_bytes(value) == answer["mooncake"], value
            continue
        with pytest.raises(ValueError):
            parse_segment_size(value)
        with pytest.raises(sizing.SizingError) as err:
            sizing.segment_bytes(value)
        assert err.value.rule == "mooncake-segment-size"


def _file_spec(**extra_config):
    return {"image": "img", "engine": "sglang", "engineVersion": engine_versions.NEWEST_CHECKED, "model": "Qwen/Qwen3-8B",
            "hicache": {"hostPool": {"sizeGBPerRank": 8},
                        "storage": {"backend": "file", "extraConfig": {"file_storage_path": "/l3", **extra_config}}},
            "extraVolumes": [{"name": "l3", "emptyDir": {}}], "extraVolumeMounts": [{"name": "l3", "mountPath": "/l3"}]}


@pytest.mark.parametrize("engine", ["sglang", "bundled"])
def test_apply_time_validation_says_what_to_write(engine):
    raw = _file_spec(max_size="200g", min_free_space="10Gi")
    if engine == "bundled":
        raw.update(engine="bundled", model="builtin:tiny")
        raw.pop("engineVersion")
    out = validation.validate(raw, name="demo")
    errors = [f for f in out.errors if f.rule == "file-backend-size"]
    assert len(errors) == 1, out.findings
    assert "extraConfig.max_size '200g'" in errors[0].message
    assert "'200G' (200000000000 bytes) or '200Gi' (214748364800 bytes)" in errors[0].message
    assert not [f for f in validation.validate(_file_spec(max_size="200G"), name="demo").findings
                if f.rule == "file-backend-size"]


def test_apply_time_validation_reads_the_env_when_extra_config_is_silent():
    raw = _file_spec()
    raw["env"] = [{"name": "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE", "value": "10K"}]
    messages = [f.message for f in validation.validate(raw, name="demo").errors if f.rule == "file-backend-size"]
    assert messages and "env SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE '10K'" in messages[0]
    assert "'10k' (10000 bytes) or '10Ki' (10240 bytes)" in messages[0]
