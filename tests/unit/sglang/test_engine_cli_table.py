"""hicache_operator/plan/engine/cli.json holds what each checked SGLang release's own parser knows, and
extraArgs are read against it: a flag the release's parser refuses is refused, one it accepts is not."""

from __future__ import annotations

import pytest

from hicache_operator.plan.engine import cli as engine_cli, versions as engine_versions
from testbed import engine_cli as generator
from testbed import sglang_oracle

PARSE = generator.PARSER + """
answers = []
for argv in json.load(sys.stdin)["argvs"]:
    try:
        parser().parse_args(["--model-path", "m", *argv])
        answers.append(None)
    except (argparse.ArgumentError, SystemExit) as exc:
        answers.append(str(exc))
print(json.dumps({"flags": option_strings(), "answers": answers}))
"""
CASES = [["--mem-fraction-static", "0.8"], ["--mem-fraction-statc", "0.8"], ["--log-level=debug"], ["--hicache"],
         ["--enable-metrics-for-all-schedulers"], ["--attn-dp-size", "1"], ["--no-such-flag"], ["--tp", "2"]]


@pytest.mark.slow
@pytest.mark.parametrize("version", engine_versions.ORACLE_VERSIONS)
def test_the_table_is_the_releases_parser_and_refuses_what_it_refuses(version):
    if not sglang_oracle.installed(version):
        pytest.fail(f"sglang {version} is not installed: run scripts/setup.sh (scripts/install-sglang.sh)")
    answer = sglang_oracle.run(version, PARSE, {"argvs": CASES})
    assert engine_cli._table()["sglang"][version] == generator.groups(answer["flags"]), \
        "run python -m testbed.engine_cli"
    for argv, error in zip(CASES, answer["answers"]):
        unknown = [p for p in engine_cli.check(argv, "sglang", version) if p[0] == "unknown"]
        assert bool(unknown) == (error is not None), (version, argv, error, unknown)
