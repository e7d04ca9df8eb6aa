"""Where the Mooncake backend gets its settings, with SGLang's precedence.

1. extra_config, if it names ``master_server_address`` (fields it omits take the defaults);
2. else the JSON file at ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``;
3. else environment variables (``MOONCAKE_MASTER`` required).

``master_server_address`` is ``host:port`` of the master, or ``etcd://host:port[;host:port...]``
for highly available masters, whose elected leader the client finds in etcd (with the
``MC_STORE_CLUSTER_ID`` the masters were started with).

Whatever the source, a ``MOONCAKE_LOCAL_HOSTNAME`` (or legacy ``LOCAL_HOSTNAME``) in this
process's environment replaces ``local_hostname``: the hostname is per pod (SGLang issue #23457:
one hostname broadcast to every node made peers dial the wrong address), so the operator sets it
from the downward API while the shared config cannot know it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping

DEFAULT_GLOBAL_SEGMENT_SIZE = 4 * 1024**3
DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024**2

# Keys SGLang's Mooncake backend reads from its JSON / extra_config.
SGLANG_KEYS = {
    "local_hostname", "metadata_server", "master_server_address", "protocol", "device_name",
    "global_segment_size", "local_buffer_size", "master_metrics_port", "check_server", "extra_backend_tag",
}
# Ours: bounded waits so a missing master never stalls the engine.
RUNTIME_KEYS = {"master_wait_s", "retry_interval_s"}


@dataclass
class MooncakeStoreConfig:
    master_server_address: str
    local_hostname: str = "localhost"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    protocol: str = "tcp"
    device_name: str = ""
    master_metrics_port: int = 9003
    check_server: bool = False
    source: str = field(default="", compare=False)  # where it came from, for logs and errors

    @property
    def through_etcd(self) -> bool:
        return self.master_server_address.startswith(ETCD_PREFIX)

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """Where the store is reached: the master, or each etcd member the leader is found through."""
        return _endpoints(self.master_server_address)


ETCD_PREFIX = "etcd://"


def _endpoints(address: str) -> list[tuple[str, int]]:
    """``host:port`` or ``etcd://host:port;host:port`` as (host, port) pairs; ValueError otherwise."""
    parts = address[len(ETCD_PREFIX):].split(";") if address.startswith(ETCD_PREFIX) else [address]
    out = []
    for part in parts:
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} is not host:port")
        out.append((host, int(port)))
    return out


def parse_segment_size(value, what: str = "global_segment_size") -> int:
    """Bytes as SGLang's Mooncake backend reads a size (``mooncake_store._parse_global_segment_size``):
    an int as is, a float truncated, a string of bytes or ``"<N>gb"`` (N GiB, any case). Strings it
    cannot read ('64G', '64GiB', '1.5gb') raise, as they make SGLang fail at start; so do negative
    sizes and booleans, which no store can lend."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count, got {value!r}")
    try:
        if isinstance(value, str):
            text = value.strip().lower()
            if text.endswith("gb"):
                number = text[:-2].strip()
                if not number:
                    raise ValueError("missing number before 'gb'")
                size = int(number) * 1024**3
            else:
                size = int(text)
        else:
            size = int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: cannot parse {value!r} (bytes, or '<N>gb' for N GiB, e.g. '4gb')") from exc
    if size < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return size


def _as_bool(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{what} must be a boolean, got {value!r}")


def _build(fields: Mapping, source: str) -> MooncakeStoreConfig:
    master = fields.get("master_server_address")
    if not master:
        raise ValueError(f"mooncake config from {source}: master_server_address is required (host:port)")
    try:
        _endpoints(str(master))
    except ValueError:
        raise ValueError(f"mooncake config from {source}: master_server_address must be host:port or "
                         f"etcd://host:port[;host:port...], got {master!r}") from None
    cfg = MooncakeStoreConfig(master_server_address=str(master), source=source)
    if fields.get("local_hostname"):
        cfg.local_hostname = str(fields["local_hostname"])
    if fields.get("metadata_server"):
        cfg.metadata_server = str(fields["metadata_server"])
    if fields.get("protocol"):
        cfg.protocol = str(fields["protocol"])
    if fields.get("device_name") is not None:
        cfg.device_name = str(fields["device_name"])
    if fields.get("global_segment_size") is not None:
        cfg.global_segment_size = parse_segment_size(fields["global_segment_size"])
    if fields.get("local_buffer_size") is not None:
        cfg.local_buffer_size = parse_segment_size(fields["local_buffer_size"], "local_buffer_size")
    if fields.get("master_metrics_port") is not None:
        try:
            cfg.master_metrics_port = int(fields["master_metrics_port"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"master_metrics_port must be an integer, got {fields['master_metrics_port']!r}") from exc
    if fields.get("check_server") is not None:
        cfg.check_server = _as_bool(fields["check_server"], "check_server")
    if cfg.check_server and cfg.through_etcd:
        raise ValueError(f"mooncake config from {source}: check_server reads the master's segment list, which an "
                         "etcd:// address does not locate; leave check_server unset")
    return cfg


def load_mooncake_config(extra_config: Mapping | None, environ: Mapping[str, str] = os.environ) -> MooncakeStoreConfig:
    extra = extra_config or {}
    if extra.get("master_server_address") is not None:
        cfg = _build(extra, "extra_config")
    elif environ.get("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        path = environ["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"]
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read mooncake config {path!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"mooncake config {path!r} must hold a JSON object")
        cfg = _build(data, f"file {path}")
    elif environ.get("MOONCAKE_MASTER"):
        cfg = _build({
            "master_server_address": environ["MOONCAKE_MASTER"],
            "metadata_server": environ.get("MOONCAKE_TE_META_DATA_SERVER"),
            "protocol": environ.get("MOONCAKE_PROTOCOL"),
            "device_name": environ.get("MOONCAKE_DEVICE"),
            "global_segment_size": environ.get("MOONCAKE_GLOBAL_SEGMENT_SIZE"),
            "local_buffer_size": environ.get("SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE"),
            "master_metrics_port": environ.get("MOONCAKE_MASTER_METRICS_PORT"),
            "check_server": environ.get("MOONCAKE_CHECK_SERVER"),
        }, "environment")
    else:
        raise ValueError("mooncake backend: no master configured: set extra_config master_server_address, "
                         "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, or MOONCAKE_MASTER")
    pod_hostname = environ.get("MOONCAKE_LOCAL_HOSTNAME") or environ.get("LOCAL_HOSTNAME")
    if pod_hostname:
        cfg.local_hostname = pod_hostname
    return cfg
