"""``python -m cache_runtime serve [SGLang flags]``."""

from __future__ import annotations

import sys

from cache_runtime.args import args_from_namespace, build_parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        args = args_from_namespace(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cache_runtime.server.app import run

    try:
        run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
