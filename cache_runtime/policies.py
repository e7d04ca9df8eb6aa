"""HiCache policy names and the L3 prefetch knobs SGLang pops out of the storage extra-config."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
IO_BACKENDS = ("kernel", "direct")


def write_through_threshold(policy: str) -> int:
    """Hits before a node is copied to L2: write_through backs up on insert, selective on reuse."""
    return 1 if policy == "write_through" else 2


def check_policy(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"invalid {kind} {value!r}; expected one of {', '.join(allowed)}")
    return value


@dataclass
class PrefetchConfig:
    """The engine's L3 prefetch knobs, popped from the extra config before the backend sees it. SGLang
    (0.5.9-0.5.23) reads threshold, base, per-1024-token and pass_prefix_keys; ``timeout_max``, the cap
    on the timeout and on wait_complete, is this runtime's own."""

    policy: str = "best_effort"
    threshold: int = 256  # tokens; prefetches smaller than this are not issued
    timeout_base: float = 2.0
    timeout_per_ki_token: float = 0.1
    timeout_max: float = 30.0
    pass_prefix_keys: bool = False

    def timeout_for(self, num_tokens: int) -> float:
        """SGLang's base + per_ki_token * tokens / 1024, capped at ``timeout_max``."""
        return min(self.timeout_max, self.timeout_base + self.timeout_per_ki_token * num_tokens / 1024)

    @classmethod
    def from_extra_config(cls, policy: str, extra: dict) -> tuple["PrefetchConfig", dict]:
        """Splits the engine's knobs from the backend's keys; raises ValueError on bad knob values."""
        check_policy("hicache_storage_prefetch_policy", policy, PREFETCH_POLICIES)
        rest = dict(extra)
        cfg = cls(policy=policy)
        for name, attr, typ in (("prefetch_threshold", "threshold", int),
                                ("prefetch_timeout_base", "timeout_base", float),
                                ("prefetch_timeout_per_ki_token", "timeout_per_ki_token", float),
                                ("prefetch_timeout_max", "timeout_max", float)):
            if name not in rest:
                continue
            raw = rest.pop(name)
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or (typ is int and raw != int(raw)):
                raise ValueError(f"extra-config {name} must be a {typ.__name__}, got {raw!r}")
            if raw < 0:
                raise ValueError(f"extra-config {name} must be >= 0, got {raw!r}")
            setattr(cfg, attr, typ(raw))
        if "hicache_storage_pass_prefix_keys" in rest:
            raw = rest.pop("hicache_storage_pass_prefix_keys")
            if not isinstance(raw, bool):
                raise ValueError(f"extra-config hicache_storage_pass_prefix_keys must be a boolean, got {raw!r}")
            cfg.pass_prefix_keys = raw
        return cfg, rest
