"""Local test clusters only: `python -m sglang.launch_server ARGS` runs the bundled runtime in
SGLang-compatibility mode with the same ARGS.

The podrunner puts this directory on PYTHONPATH, so `engine: sglang` pods, whose command the
operator renders exactly as for real SGLang, run as real processes that speak only SGLang's
routes (no drain switch, no /ready, no /load): the operator is tested against SGLang's API
without a GPU. Flags the bundled runtime does not take are dropped, parallelism runs as one rank,
and a model that is not a built-in one is served by builtin:tiny, each with a note on stderr.
"""
from __future__ import annotations

import os
import sys

IGNORED = {"--enable-metrics": 0}  # flag -> number of values it takes (our runtime always serves /metrics)
ONE_RANK = ("--tp-size", "--dp-size", "--pp-size")  # a stand-in process, not the GPUs the pod asks for


def main(argv: list[str]) -> None:
    args: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--model-path" and i + 1 < len(argv) and not argv[i + 1].startswith("builtin:"):
            print(f"sglang shim: serving {argv[i + 1]} with builtin:tiny", file=sys.stderr)
            args += ["--model-path", "builtin:tiny"]
            i += 2
            continue
        if argv[i] in ONE_RANK and i + 1 < len(argv):
            print(f"sglang shim: {argv[i]} {argv[i + 1]} runs as 1", file=sys.stderr)
            args += [argv[i], "1"]
            i += 2
            continue
        if argv[i] in IGNORED:
            print(f"sglang shim: ignoring {argv[i]}", file=sys.stderr)
            i += 1 + IGNORED[argv[i]]
            continue
        args.append(argv[i])
        i += 1
    os.execv(sys.executable, [sys.executable, "-m", "cache_runtime", "serve", "--compat-mode", "sglang", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
