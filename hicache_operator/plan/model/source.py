"""``spec.modelSource`` as pod parts: the volume that holds the checkpoint, the engine's
``--model-path`` into it, the model-download init container, the startup probe's budget, and the
claims the pods need. Pure functions of the spec; ``render`` assembles them.

Every source is mounted read-only at ``MODEL_DIR`` in the engine's container, which reads it with
HF_HUB_OFFLINE=1 and serves it as ``spec.model`` (``--served-model-name``):

- huggingFace: the cache claim; the init container (the engine's image, ``model_download.py``
  from ConfigMap ``<name>-model``) writes ``<cache.path>/<org>--<name>/<revision>`` once;
- pvc: the claim, read-only; the checkpoint at ``path``;
- hostPath: the node's directory;
- image: an image volume (``volumes[].image``); the checkpoint at ``path`` inside the image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_operator.api import flags
from hicache_operator.plan.model import download as model_download
from hicache_operator.api.rules import rule
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.spec_model import HuggingFaceSource

MODEL_VOLUME = "model"
MODEL_DIR = "/hicache/model"
DOWNLOAD_CONTAINER = "model-download"
DOWNLOAD_VOLUME = "model-download"
DOWNLOAD_DIR = "/etc/hicache/model-download"
DOWNLOAD_SCRIPT = "model_download.py"
PROGRESS_PATH = model_download.PROGRESS_PATH
STARTUP_PROBE_PERIOD = 10
STARTUP_SECONDS = 600  # load from local disk into GPU memory, pools allocated
STARTUP_SECONDS_ENGINE_DOWNLOADS = 1800  # engine sglang given a Hub id downloads it under the probe
# The download's own container: it needs a core and some memory, never a GPU.
DOWNLOAD_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "8Gi"}}


def configmap_name(owner_name: str) -> str:
    return f"{owner_name}-model"


def is_hub_id(model: str) -> bool:
    return not model.startswith("/") and not model.startswith("builtin:")


def hub_dir(model: str, hf: HuggingFaceSource) -> str:
    """The download's directory inside the cache claim: <path>/<org>--<name>/<revision>."""
    parts = [hf.cache.path, model.replace("/", "--"), hf.revision.replace("/", "--")]
    return "/".join(p for p in parts if p)


def model_path(spec: HiCacheDeploymentSpec) -> str:
    """The engine's --model-path."""
    src = spec.model_source
    if src is None:
        return spec.model
    if src.hugging_face is not None:
        return f"{MODEL_DIR}/{hub_dir(spec.model, src.hugging_face)}"
    inner = src.pvc.path if src.pvc is not None else src.image.path if src.image is not None else ""
    return f"{MODEL_DIR}/{inner}" if inner else MODEL_DIR


def served_name(spec: HiCacheDeploymentSpec) -> str | None:
    """--served-model-name: spec.model when a source gives the path, else the engine's default."""
    return spec.model if spec.model_source is not None else None


def volumes(spec: HiCacheDeploymentSpec, owner_name: str) -> list[dict[str, Any]]:
    src = spec.model_source
    if src is None:
        return []
    if src.hugging_face is not None:
        return [{"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": src.hugging_face.cache.claim_name}},
                {"name": DOWNLOAD_VOLUME, "configMap": {"name": configmap_name(owner_name)}}]
    if src.pvc is not None:
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": src.pvc.claim_name, "readOnly": True}}
    elif src.host_path is not None:
        source = {"hostPath": {"path": src.host_path.path, "type": "Directory"}}
    else:
        assert src.image is not None
        image = {"reference": src.image.reference}
        if src.image.pull_policy:
            image["pullPolicy"] = src.image.pull_policy
        source = {"image": image}
    return [{"name": MODEL_VOLUME, **source}]


def reserved_mounts(spec: HiCacheDeploymentSpec) -> dict[str, str]:
    """Volume name -> mount path this module adds (extraVolumes and extraVolumeMounts must not clash)."""
    if spec.model_source is None:
        return {}
    out = {MODEL_VOLUME: MODEL_DIR}
    if spec.model_source.hugging_face is not None:
        out[DOWNLOAD_VOLUME] = DOWNLOAD_DIR
    return out


def mounts(spec: HiCacheDeploymentSpec) -> list[dict[str, Any]]:
    """The engine container's mounts."""
    if spec.model_source is None:
        return []
    return [{"name": MODEL_VOLUME, "mountPath": MODEL_DIR, "readOnly": True}]


def engine_env(spec: HiCacheDeploymentSpec) -> list[dict[str, Any]]:
    """The engine reads the local copy: no Hub calls from the serving container."""
    return [{"name": "HF_HUB_OFFLINE", "value": "1"}] if spec.model_source is not None else []


def init_containers(spec: HiCacheDeploymentSpec, owner_name: str, *, pod_ip_env: dict[str, Any],
                    security_context: dict[str, Any]) -> list[dict[str, Any]]:
    """The model-download init container (huggingFace only)."""
    src = spec.model_source
    if src is None or src.hugging_face is None:
        return []
    hf = src.hugging_face
    args = ["--repo", spec.model, "--revision", hf.revision, "--dest", model_path(spec),
            "--port", str(flags.RUNTIME_PORT)]
    for pattern in hf.allow_patterns or []:
        args += ["--allow", pattern]
    for pattern in hf.ignore_patterns:
        args += ["--ignore", pattern]
    env = [pod_ip_env, {"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if hf.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hf.endpoint})
    if hf.token_secret_ref is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": hf.token_secret_ref.name, "key": hf.token_secret_ref.key}}})
    container: dict[str, Any] = {
        "name": DOWNLOAD_CONTAINER,
        "image": spec.image,
        "command": ["python", f"{DOWNLOAD_DIR}/{DOWNLOAD_SCRIPT}"],
        "args": [flags.escape(a) for a in args],
        "env": env,
        "resources": DOWNLOAD_RESOURCES,
        "securityContext": security_context,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": MODEL_DIR},
                         {"name": DOWNLOAD_VOLUME, "mountPath": DOWNLOAD_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    return [container]


def configmap_data() -> dict[str, str]:
    """ConfigMap <name>-model: the download script the init container runs."""
    return {DOWNLOAD_SCRIPT: Path(model_download.__file__).read_text()}


def startup_seconds(spec: HiCacheDeploymentSpec) -> int:
    if spec.startup_timeout_seconds is not None:
        return spec.startup_timeout_seconds
    engine_downloads = spec.engine == "sglang" and spec.model_source is None and is_hub_id(spec.model)
    return STARTUP_SECONDS_ENGINE_DOWNLOADS if engine_downloads else STARTUP_SECONDS


def startup_failure_threshold(spec: HiCacheDeploymentSpec) -> int:
    return math.ceil(startup_seconds(spec) / STARTUP_PROBE_PERIOD)


@dataclass(frozen=True)
class Claim:
    name: str
    field: str  # the spec field that names it
    writes: bool  # the pods write to it (the download cache)


def claims(spec: HiCacheDeploymentSpec) -> list[Claim]:
    src = spec.model_source
    if src is None:
        return []
    if src.hugging_face is not None:
        return [Claim(src.hugging_face.cache.claim_name, "modelSource.huggingFace.cache", True)]
    if src.pvc is not None:
        return [Claim(src.pvc.claim_name, "modelSource.pvc", False)]
    return []


def claim_problems(spec: HiCacheDeploymentSpec, access_modes: dict[str, list[str] | None]) -> list[tuple[str, str]]:
    """(reason, message) for Degraded, from each claim's access modes (None: no such claim)."""
    out = []
    for claim in claims(spec):
        modes = access_modes.get(claim.name)
        if modes is None:
            out.append(("ModelClaimMissing", f"PersistentVolumeClaim {claim.name} ({claim.field}) does not exist: "
                                             "create it; the pods stay Pending until it does"))
            continue
        shared = {"ReadWriteMany"} if claim.writes else {"ReadWriteMany", "ReadOnlyMany"}
        if spec.replicas > 1 and not shared & set(modes):
            out.append(("ModelClaimNotShared", rule("model-claim-not-shared").message.format(
                what=claim.field, claim=claim.name, modes=", ".join(modes) or "none", replicas=spec.replicas,
                needed=" or ".join(sorted(shared, reverse=True)))))
    return out


def token_secret(spec: HiCacheDeploymentSpec) -> str | None:
    src = spec.model_source
    ref = src.hugging_face.token_secret_ref if src is not None and src.hugging_face is not None else None
    return ref.name if ref is not None else None
