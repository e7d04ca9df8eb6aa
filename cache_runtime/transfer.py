"""L1<->L2 copies on a background thread, so loads and backups overlap with the forward pass.

Loads complete layer by layer: the forward waits for layer ``i`` of a pending load just before
its attention reads that layer, which is how SGLang overlaps H2D traffic with compute. All
bookkeeping (tree, refs, allocators) stays on the engine thread; this thread only copies and
reports each finished op back through ``completed``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Callable

import torch

import kernels
from cache_runtime.memory import DevicePool, HostPool

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    pass


def prepare_load(device: DevicePool, host: HostPool, host_slots: torch.Tensor, device_slots: torch.Tensor,
                 io_backend: str) -> kernels.LayerLoads:
    """L2 -> L1 copy of every layer, checked and its slots placed once; ``.load(layer)`` issues one layer."""
    return kernels.prepare_load(host.kv_buffer, device.k, device.v, host_slots, device_slots, host.layout,
                                host.page_size, io_backend=io_backend)


def backup_layers(device: DevicePool, host: HostPool, device_slots: torch.Tensor, host_slots: torch.Tensor,
                  io_backend: str) -> None:
    """L1 -> L2 copy of every layer."""
    kernels.backup_all_layers(device.k, device.v, host.kv_buffer, device_slots, host_slots, host.layout,
                              host.page_size, io_backend=io_backend)


class _Op:
    def __init__(self, nodes, device_slots: torch.Tensor, host_slots: torch.Tensor, lock_node) -> None:
        self.nodes = list(nodes)  # split() appends new parents, so failures can reach every piece
        self.device_slots = device_slots
        self.host_slots = host_slots
        self.lock_node = lock_node  # path-locked (L1) and path-pinned (L2) until the engine acks the op
        self.done = False  # set by the engine thread when it processes the ack
        self.error: BaseException | None = None


class LoadOp(_Op):
    """L2 -> L1 copy of a chain of evicted nodes."""

    def __init__(self, nodes, device_slots, host_slots, lock_node, num_layers: int) -> None:
        super().__init__(nodes, device_slots, host_slots, lock_node)
        self.layer_ready = [threading.Event() for _ in range(num_layers)]
        self.cuda_events: list = [None] * num_layers

    def wait_layer(self, layer: int) -> None:
        self.layer_ready[layer].wait()
        if self.error is not None:
            raise TransferError(f"L2->L1 load failed: {self.error}")
        ev = self.cuda_events[layer]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


class BackupOp(_Op):
    """L1 -> L2 copy of one node (write-through policies)."""

    def __init__(self, nodes, device_slots, host_slots, lock_node) -> None:
        super().__init__(nodes, device_slots, host_slots, lock_node)
        self.hashes: list[str] | None = None  # L3 keys of its pages, when an L3 backend is attached
        self.ready_event = None  # CUDA: the compute stream's writes this copy must wait for


class TransferWorker:
    def __init__(self, device: DevicePool, host: HostPool, io_backend: str, wake: Callable[[], None],
                 mirror: Callable[[tuple], None] | None = None) -> None:
        self.device, self.host, self.io_backend = device, host, io_backend
        self._mirror = mirror  # tensor parallelism: the same copy on every follower rank (cache_runtime.engine.tp)
        self._wake = wake
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self.completed: queue.SimpleQueue = queue.SimpleQueue()
        self._cuda = device.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device.device) if self._cuda else None
        self._thread = threading.Thread(target=self._run, name="hicache-transfer", daemon=True)
        self._thread.start()

    def submit_load(self, op: LoadOp) -> None:
        if self._mirror is not None:
            self._mirror(("load", op.host_slots, op.device_slots))
        self._queue.put((0, next(self._seq), op))  # loads first: a request is waiting on them

    def submit_backup(self, op: BackupOp) -> None:
        if self._mirror is not None:
            self._mirror(("backup", op.device_slots, op.host_slots))
        if self._cuda:
            op.ready_event = torch.cuda.Event()
            op.ready_event.record(torch.cuda.current_stream())
        self._queue.put((1, next(self._seq), op))

    def stop(self) -> None:
        self._queue.put((-1, next(self._seq), None))
        self._thread.join(timeout=10)

    def backup_now(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Synchronous L1->L2 copy on the caller's thread (write_back eviction)."""
        if self._mirror is not None:
            self._mirror(("backup", device_slots, host_slots))
        if self._cuda:
            torch.cuda.current_stream().synchronize()
        backup_layers(self.device, self.host, device_slots, host_slots, self.io_backend)
        if self._cuda:
            torch.cuda.current_stream().synchronize()

    def _run(self) -> None:
        torch.set_num_threads(1)  # copies are memory-bound; the cores belong to the engine thread
        while True:
            _, _, op = self._queue.get()
            if op is None:
                return
            try:
                if self._cuda:
                    with torch.cuda.stream(self._stream):
                        self._execute(op)
                    self._stream.synchronize()
                else:
                    self._execute(op)
            except Exception as exc:  # surfaced to the requests that wait on the op
                log.exception("KV transfer failed")
                op.error = exc
            finally:
                if isinstance(op, LoadOp):
                    for ev in op.layer_ready:
                        ev.set()
                self.completed.put(op)
                self._wake()

    def _execute(self, op) -> None:
        if isinstance(op, LoadOp):
            loads = prepare_load(self.device, self.host, op.host_slots, op.device_slots, self.io_backend)
            for layer in range(loads.num_layers):
                loads.load(layer)
                if self._cuda:
                    ev = torch.cuda.Event()
                    ev.record(self._stream)
                    op.cuda_events[layer] = ev
                op.layer_ready[layer].set()
        else:
            if op.ready_event is not None:
                self._stream.wait_event(op.ready_event)
            backup_layers(self.device, self.host, op.device_slots, op.host_slots, self.io_backend)
