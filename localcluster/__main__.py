"""Command line for the local control plane.

  python -m localcluster build            build/cache the binaries, print the bin dir
  python -m localcluster up [--gpu-nodes N --cpu-nodes M --workdir D]
  python -m localcluster down [--workdir D]
  python -m localcluster env [--workdir D]   # eval "$(...)" for KUBECONFIG and PATH
  python -m localcluster exec -- kubectl get nodes

`up` creates a persistent named network namespace (`ip netns add hicache-<name>`) when
run as root, starts every component inside it and returns; `exec` runs a command in
that namespace with KUBECONFIG set; `down` stops the components by PID and deletes
the namespace.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import cluster
from .nodes import default_nodes

DEFAULT_WORKDIR = Path(os.environ.get("HICACHE_CLUSTER_DIR", "/tmp/hicache-cluster"))


def netns_name(workdir: Path) -> str:
    return "hicache-" + workdir.name.replace("_", "-")[:40]


def _in_netns(ns: str | None, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv] if ns else argv


def cmd_up(a: argparse.Namespace) -> int:
    workdir = a.workdir.resolve()
    if (workdir / "cluster.json").exists():
        print(f"a cluster is already up in {workdir}; run `down` first", file=sys.stderr)
        return 1
    bin_dir = cluster.ensure_binaries()
    ns = None
    if os.geteuid() == 0 and not a.no_netns:
        ns = netns_name(workdir)
        subprocess.run(["ip", "netns", "add", ns], check=False, capture_output=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    # The cluster object must live inside the namespace: re-run ourselves there, detached.
    argv = _in_netns(ns, [sys.executable, "-m", "localcluster", "_serve", "--workdir", str(workdir),
                          "--bin-dir", str(bin_dir), "--gpu-nodes", str(a.gpu_nodes),
                          "--cpu-nodes", str(a.cpu_nodes)])
    workdir.parent.mkdir(parents=True, exist_ok=True)
    logf = open(str(workdir) + ".serve.log", "ab")
    env = {**os.environ, "PYTHONPATH": str(cluster.REPO)}
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            cwd=cluster.REPO)
    t0 = time.monotonic()
    while time.monotonic() - t0 < a.timeout:
        if (workdir / "ready").exists():
            state = json.loads((workdir / "cluster.json").read_text())
            state.update(netns=ns, serve_pid=proc.pid)
            (workdir / "cluster.json").write_text(json.dumps(state, indent=2))
            print(f"cluster up in {time.monotonic() - t0:.1f}s: kubeconfig {workdir / 'admin.kubeconfig'}"
                  + (f", network namespace {ns}" if ns else ""))
            return 0
        if proc.poll() is not None:
            print(open(str(workdir) + ".serve.log").read()[-4000:], file=sys.stderr)
            return 1
        time.sleep(0.5)
    print("timed out waiting for the cluster", file=sys.stderr)
    return 1


def cmd_serve(a: argparse.Namespace) -> int:
    """Internal: start the cluster in this process's namespace and keep it until SIGTERM."""
    import signal
    nodes = default_nodes(a.gpu_nodes, a.cpu_nodes)
    c = cluster.LocalCluster(a.workdir, nodes=nodes, bin_dir=a.bin_dir)
    c.start()
    (a.workdir / "ready").write_text(f"{c.startup_seconds:.1f}\n")

    def bye(*_):
        c.stop()
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    while True:
        time.sleep(3600)


def _state(workdir: Path) -> dict:
    p = workdir / "cluster.json"
    if not p.exists():
        raise SystemExit(f"no cluster in {workdir}")
    return json.loads(p.read_text())


def cmd_down(a: argparse.Namespace) -> int:
    workdir = a.workdir.resolve()
    try:
        state = _state(workdir)
    except SystemExit:
        print(f"no cluster in {workdir}")
        return 0
    pids = dict(state.get("pids", {}))
    if state.get("serve_pid"):
        pids["serve"] = state["serve_pid"]
    cluster.stop_pids(pids)
    if state.get("netns"):
        subprocess.run(["ip", "netns", "delete", state["netns"]], check=False)
    (workdir / "cluster.json").unlink(missing_ok=True)
    (workdir / "ready").unlink(missing_ok=True)
    print(f"cluster in {workdir} stopped")
    return 0


def cmd_env(a: argparse.Namespace) -> int:
    state = _state(a.workdir.resolve())
    print(f"export KUBECONFIG={state['kubeconfig']}")
    print(f"export PATH={state['bin_dir']}:$PATH")
    return 0


def cmd_exec(a: argparse.Namespace) -> int:
    state = _state(a.workdir.resolve())
    env = {**os.environ, "KUBECONFIG": state["kubeconfig"],
           "PATH": f"{state['bin_dir']}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    return subprocess.call(_in_netns(state.get("netns"), argv), env=env)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m localcluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build the cluster binaries into the cache (no-op when present)")
    for name in ("up", "down", "env", "exec", "_serve"):
        p = sub.add_parser(name, help=None if name.startswith("_") else name)
        p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
        if name in ("up", "_serve"):
            p.add_argument("--gpu-nodes", type=int, default=3)
            p.add_argument("--cpu-nodes", type=int, default=1)
        if name == "up":
            p.add_argument("--timeout", type=float, default=180)
            p.add_argument("--no-netns", action="store_true", help="loopback pod IPs, no EndpointSlices")
        if name == "_serve":
            p.add_argument("--bin-dir", type=Path, required=True)
        if name == "exec":
            p.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.cmd == "build":
        print(cluster.ensure_binaries())
        return 0
    return {"up": cmd_up, "down": cmd_down, "env": cmd_env, "exec": cmd_exec, "_serve": cmd_serve}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
