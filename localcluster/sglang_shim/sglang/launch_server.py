"""Local test clusters only: `python -m sglang.launch_server ARGS` runs the bundled runtime in
SGLang-compatibility mode with the same ARGS, after real SGLang has accepted them.

The local cluster puts this directory on the podrunner's PYTHONPATH (beside the checkout), so `engine: sglang` pods, whose command the
operator renders exactly as for real SGLang, run as real processes that speak only SGLang's
routes: the operator is tested against SGLang's API
without a GPU. First the real `sglang` package of the release the pod runs
($HICACHE_ENGINE_VERSION, installed by scripts/install-sglang.sh) parses and resolves ARGS; a
refusal ends the process with SGLang's message, as the real server would. Then flags the bundled
runtime does not take are dropped, parallelism runs as one rank, and a model that is not a
built-in one is served by builtin:tiny, each with a note on stderr.
"""
from __future__ import annotations

import os
import sys

IGNORED = {"--enable-metrics": 0, "--enable-dp-attention": 0}  # flag -> number of values it takes
ONE_RANK = ("--tp-size", "--dp-size", "--pp-size", "--attn-dp-size")  # a stand-in process, not the pod's GPUs


def refusal(argv: list[str]) -> str | None:
    """Why real SGLang would refuse ARGS, or None when it accepts them."""
    from testbed import sglang_oracle

    version = os.environ.get("HICACHE_ENGINE_VERSION", "")
    if not sglang_oracle.installed(version):
        return f"sglang {version or '(no HICACHE_ENGINE_VERSION)'} is not installed: run scripts/install-sglang.sh"
    answer = sglang_oracle.resolve(version, [argv])[0]
    return f"real SGLang {version} refuses these arguments: {answer['error']}" if "error" in answer else None


def main(argv: list[str]) -> None:
    why = refusal(argv)
    if why:
        print(f"sglang shim: {why}", file=sys.stderr)
        sys.exit(2)
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
            if argv[i] != "--attn-dp-size":
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
