"""One tensor-parallel rank's model and KV pools: the same ``ModelRunner`` on rank 0 and on every follower.

``model_setup`` resolves, identically on every rank, what the flags and config.json decide
(device, dtypes, context length); ``l2_tokens`` sizes the host pool once, on rank 0, which hands
the number to the followers. A ``ModelRunner`` then loads this rank's shard of the weights
(timing the CPU GEMM on them), allocates its L1 pool and maps its L2 pools, and runs forwards.
It makes no decision: rank 0's engine loop and a follower's command loop (``engine/tp.py``) both
drive it, and only their owning thread calls ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_runtime import cpu_kernels
from cache_runtime.args import ServerArgs
from cache_runtime.memory import DevicePool, HostPool, device_pool_tokens, host_pool_tokens
from cache_runtime.models import load_model, resolve_config, resolve_dtype
from cache_runtime.models.base import Shard
from cache_runtime.models.config import CheckpointError, ModelConfig, kv_bytes_per_token
from cache_runtime.models.layers import ForwardBatch


def pick_device(name: str, rank: int = 0) -> torch.device:
    """The device of TP rank ``rank``: GPU ``rank`` of the pod's visible GPUs, or the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    if name == "cuda":
        if rank >= torch.cuda.device_count():
            raise ValueError(f"--tp-size needs {rank + 1} GPUs, {torch.cuda.device_count()} visible")
        return torch.device("cuda", rank)
    return torch.device(name)


@dataclass(frozen=True)
class ModelSetup:
    """What every TP rank resolves the same way from the flags and config.json."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    context_length: int


def model_setup(args: ServerArgs, rank: int = 0) -> ModelSetup:
    cfg = resolve_config(args.model_path)
    device = pick_device(args.device, rank)
    dtype = resolve_dtype(args.dtype, cfg, device)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_dtype(args.kv_cache_dtype, cfg, device)
    if args.context_length is not None and args.context_length > cfg.max_position_embeddings:
        raise CheckpointError(f"--context-length {args.context_length} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings} (config.json)")
    return ModelSetup(cfg, device, dtype, kv_dtype, args.context_length or cfg.max_position_embeddings)


def l2_tokens(args: ServerArgs, setup: ModelSetup) -> int | None:
    """Token slots of each rank's L2 pool (SGLang's formula), or None without --enable-hierarchical-cache."""
    if not args.enable_hierarchical_cache:
        return None
    token_bytes = kv_bytes_per_token(setup.cfg, str(setup.kv_dtype).removeprefix("torch."), tp=args.tp_size)
    return host_pool_tokens(device_pool_tokens(args.max_total_tokens, args.page_size), args.page_size,
                            args.hicache_ratio, args.hicache_size, token_bytes)


class ModelRunner:
    """Rank ``rank``'s shard of the model, its L1 pool and the L2 pools it maps.

    ``host_files`` names one L2 pool per entry (None: private memory; a path: a shared-memory file):
    a follower maps its own, rank 0 its own and every follower's, because rank 0 runs the L3 I/O
    of all ranks. ``host_pools[0]`` is this rank's. Without ``host_tokens`` there is no L2.
    """

    def __init__(self, args: ServerArgs, setup: ModelSetup, rank: int = 0, host_tokens: int | None = None,
                 host_files: list[str | None] | None = None) -> None:
        world = args.tp_size
        self.setup = setup
        cfg = self.cfg = setup.cfg
        self.device, self.dtype, self.kv_dtype = setup.device, setup.dtype, setup.kv_dtype
        self.context_length = setup.context_length
        heads, width = cfg.kv_row(world)
        self.device_pool = DevicePool(args.max_total_tokens, args.page_size, cfg.num_layers, heads, width,
                                      self.kv_dtype, self.device, mla=cfg.is_mla)
        loaded = load_model(args.model_path, self.dtype, self.device, self.context_length,
                            shard=Shard(rank, world) if world > 1 else None)
        self.model = loaded.model
        if self.device.type == "cpu":
            cpu_kernels.calibrate(self.model.layer_matrices())
        self.tokenizer = loaded.tokenizer
        self.generation = loaded.generation
        self.host_pools: list[HostPool] = []
        if host_tokens:
            self.host_pools = [HostPool(host_tokens, args.page_size, cfg.num_layers, heads, width, self.kv_dtype,
                                        args.hicache_mem_layout, pin=self.device.type == "cuda", mla=cfg.is_mla,
                                        buffer_file=f)
                               for f in (host_files or [None])]

    @property
    def host_pool(self) -> HostPool | None:
        """This rank's L2 pool."""
        return self.host_pools[0] if self.host_pools else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward over the batch; K/V of its new tokens land in the L1 pool. Logits of the
        sequences that want them (rank 0 samples; a follower's are discarded)."""
        return self.model(batch, self.device_pool.k, self.device_pool.v)
