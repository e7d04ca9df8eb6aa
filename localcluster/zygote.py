"""Pods forked from a zygote (podrunner with HICACHE_PODRUNNER_ZYGOTE=1): a process that has
imported torch (and nothing of any pod) forks, and the child becomes the container process, running
its module as `python -m` would. Forked children share the preloaded state copy-on-write."""
from __future__ import annotations

import gc
import importlib
import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

ZYGOTE_ENV = "HICACHE_PODRUNNER_ZYGOTE"  # "1": fork runtimes from a zygote (see podrunner's docstring)
ZYGOTE_MODULES = {"cache_runtime": ("torch",)}  # module run with -m -> what its zygote imports first


def python_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


class ForkedProcess:
    """What PodWorker needs of a Popen, for a process the zygote forked (not our child)."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.cond:
            if not self.zygote.cond.wait_for(lambda: self.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        code = self.poll()
        assert code is not None
        return code


class Zygote:
    """Client side: one `--zygote` process per preload set, driven over its stdin/stdout
    (one JSON object a line: spawn requests in; pids and exit codes out)."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "localcluster.podrunner", "--zygote", ",".join(preload)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.cond = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}  # pid -> exit code
        self.next_id = 0
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "exit" in msg:
                    self.exits[msg["exit"]] = msg["code"]
                else:
                    self.pids[msg["id"]] = msg["pid"]
                self.cond.notify_all()
        with self.cond:  # the zygote died: its children were reparented and can no longer be reaped by it
            self.cond.notify_all()

    def exit_code(self, pid: int) -> int | None:
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
        if not self.alive() and not os.path.exists(f"/proc/{pid}"):
            return -1
        return None

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
        assert self.proc.stdin is not None
        with self.send_lock:
            self.next_id += 1
            rid = self.next_id
            req = {"id": rid, "module": argv[2], "args": argv[3:], "env": env, "cwd": str(cwd), "log": str(log_path)}
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.pids or not self.alive(), timeout=60):
                raise RuntimeError("zygote did not answer")
            if rid not in self.pids:
                raise RuntimeError("zygote died")
            return ForkedProcess(self, self.pids.pop(rid))


def zygote_main(preload: list[str]) -> None:
    """Server side: import ``preload``, then fork one child per request and report exits.
    Single-threaded, so forking is safe; gc.freeze keeps the collector from touching (and
    so un-sharing) the preloaded objects' pages."""
    for module in preload:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the podrunner is gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    out.close()
                    _zygote_child(req)  # does not return
                out.write(json.dumps({"id": req["id"], "pid": pid}).encode() + b"\n")


def _zygote_child(req: dict) -> None:
    """Become the container process: what exec'ing `python -m MODULE ARGS` would have given."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)
    log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    with open("/proc/self/comm", "w") as comm:  # what ps and top show (the command line stays the zygote's)
        comm.write(req["module"][:15])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    random.seed()  # a new interpreter seeds from os.urandom; the zygote's state is shared
    sys.argv = [req["module"], *req["args"]]
    sys.path[0] = req["cwd"]  # as `python -m` puts the working directory first
    code: object = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)
