"""``python -m hicache_operator``: run the operator (kopf) with metrics and a liveness endpoint."""

from __future__ import annotations

import argparse
import os

import kopf
import prometheus_client


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hicache_operator",
        description="Kubernetes operator for HiCacheDeployment (hicache.dev/v1alpha1).")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", "-n", action="append", metavar="NS",
                       help="watch this namespace (repeatable; glob patterns allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="serve Prometheus metrics on this port (0 disables; default %(default)s)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address for the metrics server (default %(default)s)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--reconcile-interval", type=float, default=None, metavar="SECONDS",
                        help="periodic reconcile interval (env HICACHE_RECONCILE_INTERVAL, default 30)")
    parser.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                        help="HiCacheDeployments reconciled in parallel (env HICACHE_WORKERS, default 16); "
                             "each waits mostly on the API server, so large fleets want more")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.reconcile_interval is not None:
        os.environ["HICACHE_RECONCILE_INTERVAL"] = str(args.reconcile_interval)
    if args.workers is not None:
        os.environ["HICACHE_WORKERS"] = str(args.workers)
    kopf.configure(verbose=args.verbose)
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port, addr=args.metrics_host)
    from hicache_operator.control import handlers  # noqa: F401  (registers the handlers; reads the interval)

    kopf.run(clusterwide=args.all_namespaces, namespaces=args.namespace or (), liveness_endpoint=args.liveness,
             standalone=True)


if __name__ == "__main__":
    main()
