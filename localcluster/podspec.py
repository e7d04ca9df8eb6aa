"""What a kubelet resolves from a pod's spec before its process starts: `$(VAR)` expansion,
downward-API fields, where image volumes and the image's checkpoints are on this machine,
mount paths rewritten to those directories, and the /etc/hosts lines naming Services."""
from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from urllib.parse import quote

from kubernetes import client

PROCESS_BACKED_ANNOTATION = "hicache.dev/process-backed"  # pods the podrunner runs (KWOK leaves them alone)
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: unknown references stay literal, `$$` escapes."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, value)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def field_ref(pod: dict, path: str, host_ip: str, pod_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
              "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
              "status.hostIP": host_ip, "status.podIP": pod_ip, "status.podIPs": pod_ip,
              "status.hostIPs": host_ip}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ValueError(f"unsupported fieldRef {path}")


IMAGE_MODELS = "/opt/hicache/models"  # where the runtime image keeps its embedded checkpoints


def local_models_dir() -> Path:
    return Path(os.environ.get("HICACHE_MODELS_DIR") or Path.home() / ".cache" / "hicache-operator" / "models")


def image_volume_dir(images_dir: Path, reference: str) -> Path:
    """Where an image volume's files are: one directory per image reference."""
    return Path(images_dir) / quote(reference, safe="")


def rewrite_mounts(value: str, mounts: dict[str, Path]) -> str:
    """Mount paths in ``value`` as this machine's directories. One pass over all mount paths
    (longest first), so a rewritten path is never rewritten again."""
    if not mounts:
        return value
    alternatives = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
    return re.sub(rf"(?<![\w/])({alternatives})(?=/|$|\W)", lambda m: str(mounts[m.group(1)]), value)


def service_hosts(core: client.CoreV1Api, ns: str) -> list[str]:
    """/etc/hosts lines for the Services of namespace ``ns`` with a ready endpoint."""
    slices = client.DiscoveryV1Api(core.api_client).list_namespaced_endpoint_slice(ns).items
    lines = {}
    for sl in slices:
        svc = (sl.metadata.labels or {}).get("kubernetes.io/service-name")
        ready = [a for ep in sl.endpoints or [] if ep.conditions and ep.conditions.ready for a in ep.addresses]
        if svc and ready and svc not in lines:
            names = (svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local")
            lines[svc] = f"{sorted(ready)[0]}\t{' '.join(names)}"
    return list(lines.values())


def with_hosts(argv: list[str], entries: list[str], hosts: Path) -> list[str]:
    """``argv`` run in a mount namespace whose /etc/hosts (written to ``hosts``) also has ``entries``."""
    if not entries:
        return argv
    hosts.write_text(Path("/etc/hosts").read_text() + "\n# Services (localcluster/podspec.py)\n"
                     + "\n".join(entries) + "\n")
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]
