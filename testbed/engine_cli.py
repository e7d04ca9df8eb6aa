"""Writes hicache_operator/plan/engine/cli.json: the flags each engine's own parser knows.

The bundled runtime's from ``cache_runtime.args.build_parser``; SGLang's from each installed oracle
release (``engine_versions.ORACLE_VERSIONS``, testbed/sglang_oracle) through the parser
``prepare_server_args`` builds. ``table()`` is what the unit tests compare the committed file with.

    python -m testbed.engine_cli          # rewrite the file
"""

from __future__ import annotations

import argparse
import json

from hicache_operator.plan.engine import cli as engine_cli, versions as engine_versions
from testbed import sglang_oracle

# Runs under one SGLang release (sglang_oracle.run): the parser prepare_server_args builds.
PARSER = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def option_strings():
    return [a.option_strings for a in parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]
"""


def groups(actions: list[list[str]]) -> list[str]:
    """One line per flag: its option strings, space-separated, sorted for a stable file."""
    return sorted(" ".join(opts) for opts in actions if opts)


def bundled() -> list[str]:
    from cache_runtime.args import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return groups([a.option_strings for a in serve._actions if not isinstance(a, argparse._HelpAction)])


def sglang(version: str) -> list[str]:
    return groups(sglang_oracle.run(version, PARSER + "print(json.dumps(option_strings()))\n", {}))


def table() -> dict:
    return {"bundled": bundled(), "sglang": {v: sglang(v) for v in engine_versions.ORACLE_VERSIONS}}


def main() -> None:
    engine_cli.TABLE_PATH.write_text(json.dumps(table(), indent=1) + "\n")
    print(f"wrote {engine_cli.TABLE_PATH}")


if __name__ == "__main__":
    main()
