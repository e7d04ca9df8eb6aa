"""Tensor parallelism inside one server, the transport between ranks: rank 0 leads, ranks 1..N-1 follow.

Rank 0 is the server process: it owns the scheduler, the radix tree, every allocation and all L3
I/O. Followers are processes it starts (one per extra GPU on CUDA, NCCL for the activations'
all-reduce; gloo on CPU). Each runs the same ``ModelRunner`` as rank 0: its share of the weights,
its own L1 pool (its KV heads) and its own L2 pool, a shared-memory file rank 0 also maps. Everything that touches a follower's
pools is a command rank 0 broadcasts, executed in order: L2->L1 loads and L1->L2 backups, then
the forward (whose all-reduces keep the ranks in step). Because a follower executes commands in
rank 0's order, a slot rank 0 frees and reuses is reused there after the old copy too. L3 reads
and writes of follower pages run on rank 0's storage threads, after the follower has reported
(a counter in shared memory) that it executed every command sent before the L3 op was issued,
so an L3 backup never reads a follower page before its L1->L2 copy, and a prefetch never writes
a slot a pending load still reads.

A follower dies with rank 0 (parent-death signal) and rank 0 exits when a follower dies: the
pod restarts as one unit, as SGLang's does.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from cache_runtime.args import ServerArgs
from cache_runtime.engine.runner import ModelRunner, model_setup
from cache_runtime.models.layers import ForwardBatch, SeqSpan
from cache_runtime.transfer import backup_layers, prepare_load

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # a first forward of a long prompt, or a slow load
FOLLOWER_SYNC_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _init(rank: int, world: int, port: int, device: torch.device) -> None:
    dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)


def _done_counters(path: str, world: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=world, dtype=torch.int64)


def forward_command(batch: ForwardBatch) -> tuple:
    """A forward batch as plain CPU data for the followers."""
    seqs = [(s.start, s.num_new, s.ctx_slots.cpu(), s.want_logits) for s in batch.seqs]
    return ("forward", batch.input_ids.cpu(), batch.positions.cpu(), batch.out_slots.cpu(), seqs)


class Leader:
    """Rank 0's side: starts the followers, broadcasts commands, and knows what they have executed."""

    def __init__(self, args: ServerArgs, device: torch.device, host_tokens: int | None) -> None:
        self.world = args.tp_size
        self.device = device
        self.seq = 0
        self.pending: list[tuple] = []
        tag = f"hicache-tp-{os.getpid()}-{time.monotonic_ns()}"
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
        done_file = os.path.join(shm, f"{tag}-done")
        self.done = _done_counters(done_file, self.world)
        self.host_files = [os.path.join(shm, f"{tag}-host{r}") for r in range(1, self.world)] if host_tokens else []
        self._files = [done_file, *self.host_files]
        port = _free_port()
        self.procs: list[subprocess.Popen] = []
        for r in range(1, self.world):
            spec = {"rank": r, "world": self.world, "port": port, "args": asdict(args), "host_tokens": host_tokens,
                    "host_file": self.host_files[r - 1] if host_tokens else None, "done_file": done_file}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "cache_runtime.engine.tp", json.dumps(spec)],
                                               stdin=subprocess.DEVNULL))
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="tp-followers").start()
        _init(0, self.world, port, device)

    # ---- engine thread -------------------------------------------------------------------------
    def send(self, cmd: tuple) -> None:
        self.pending.append(cmd)

    def flush(self) -> None:
        """Broadcasts what was sent since the last flush; the followers run it in order."""
        if not self.pending:
            return
        self.check_alive()
        self.seq += 1
        dist.broadcast_object_list([(self.seq, self.pending)], src=0)
        self.pending = []

    def sync_point(self) -> int:
        """The sequence number after which every command sent so far has run on every follower."""
        return self.seq + (1 if self.pending else 0)

    def check_alive(self) -> None:
        dead = [f"rank {r} (exit {p.returncode})" for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead and not self._stopping.is_set():
            log.critical("tensor-parallel follower %s exited; stopping the server", ", ".join(dead))
            os._exit(3)

    def _watch(self) -> None:
        """The ranks fail as one unit at any time, also while rank 0 is blocked in a collective
        with the dead rank (loading, a forward), which would otherwise wait out its timeout."""
        while not self._stopping.wait(0.5):
            self.check_alive()

    # ---- any thread ----------------------------------------------------------------------------
    def wait_for(self, seq: int) -> None:
        """Blocks until every follower executed command list ``seq`` (storage threads, before L3 I/O)."""
        deadline = time.monotonic() + FOLLOWER_SYNC_TIMEOUT_S
        delay = 0.0005
        while int(self.done[1:].min()) < seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel followers did not reach command {seq}")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def stop(self) -> None:
        self._stopping.set()
        try:
            if all(p.poll() is None for p in self.procs):
                self.pending.append(("stop",))
                self.flush()
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        finally:
            for f in self._files:
                try:
                    os.unlink(f)
                except OSError:
                    pass
            if dist.is_initialized():
                dist.destroy_process_group()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


def execute(runner: ModelRunner, cmd: tuple, io_backend: str) -> None:
    """Runs one of rank 0's commands on this follower's model and pools."""
    op, device = cmd[0], runner.device
    if op == "forward":
        _, ids, positions, out_slots, seqs = cmd
        runner.forward(ForwardBatch(ids.to(device), positions.to(device), out_slots.to(device),
                                    [SeqSpan(a, n, ctx.to(device), False) for a, n, ctx, _ in seqs]))
    elif op == "load":  # L2 -> L1, every layer
        _, host_slots, device_slots = cmd
        loads = prepare_load(runner.device_pool, runner.host_pool, host_slots, device_slots, io_backend)
        for layer in range(loads.num_layers):
            loads.load(layer)
    elif op == "backup":  # L1 -> L2
        _, device_slots, host_slots = cmd
        backup_layers(runner.device_pool, runner.host_pool, device_slots, host_slots, io_backend)


def follower_main(rank: int, world: int, port: int, args_dict: dict, host_tokens: int | None,
                  host_file: str | None, done_file: str) -> None:
    """A follower rank: loads its shard and pools, then executes rank 0's commands until told to stop."""
    _die_with_parent()
    args = ServerArgs(**args_dict)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    torch.set_num_threads(args.cpu_threads)
    setup = model_setup(args, rank)
    device = setup.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init(rank, world, port, device)
    runner = ModelRunner(args, setup, rank, host_tokens, [host_file])
    done = _done_counters(done_file, world)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        seq, cmds = box[0]
        for cmd in cmds:
            if cmd[0] == "stop":
                dist.destroy_process_group()
                return
            execute(runner, cmd, args.hicache_io_backend)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        done[rank] = seq


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    follower_main(spec["rank"], spec["world"], spec["port"], spec["args"], spec["host_tokens"], spec["host_file"],
                  spec["done_file"])
