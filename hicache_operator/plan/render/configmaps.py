"""ConfigMap ``<name>-storage`` (the storage extra config JSON, its page namespace applied) and,
with modelSource.huggingFace, ConfigMap ``<name>-model`` (the download script)."""

from __future__ import annotations

import json
from typing import Any

from hicache_operator.api import flags
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.fleet.names import names
from hicache_operator.plan.model import source as model_source
from hicache_operator.plan.render.common import Owner, meta, stamp
from hicache_operator.plan.render.runtime import effective_extra_config


def configmap(spec: HiCacheDeploymentSpec, owner: Owner) -> dict[str, Any]:
    body = json.dumps(effective_extra_config(spec), sort_keys=True, indent=2)
    return stamp({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": meta(owner, names(owner.name).configmap, "storage-config"),
        "data": {flags.STORAGE_CONFIG_FILE: body},
    })


def model_configmap(spec: HiCacheDeploymentSpec, owner: Owner) -> dict[str, Any] | None:
    """ConfigMap <name>-model (the download script), with modelSource.huggingFace only."""
    if spec.model_source is None or spec.model_source.hugging_face is None:
        return None
    return stamp({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": meta(owner, model_source.configmap_name(owner.name), "model-download"),
        "data": model_source.configmap_data(),
    })
