"""`python -m kernels build|info`: compile the library eagerly, or show the backend."""

from __future__ import annotations

import argparse
import json
import sys

from kernels import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile transfer.cu into the cache (no-op when cached)")
    b.add_argument("--force", action="store_true", help="recompile even if cached")
    sub.add_parser("info", help="print backend_info() as JSON")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        try:
            tc = build.toolchain()
            path = build.build(force=args.force)
        except build.BuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{path}  (nvcc {tc.release}, {tc.nvcc})")
        return 0
    from kernels import backend_info

    print(json.dumps(backend_info(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
