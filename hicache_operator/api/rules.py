"""Named rules: every error, warning and normalisation the operator can report about a spec.

A rule's name is what Events, conditions and ``status.effectiveConfig`` carry, and what
``manifests/samples/invalid/<rule>.yaml`` is named after. Rules that can be checked on the object
alone also carry a CEL expression; the generated CRD attaches it to the schema node named by
``scope`` so the API server refuses the object with the very message the operator would post.
Messages say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hicache_operator.api import labels

Severity = Literal["error", "warning", "normalised"]


@dataclass(frozen=True)
class Rule:
    name: str
    severity: Severity
    message: str  # static for CEL rules; a str.format template otherwise
    cel: str | None = None
    scope: str | None = None  # the schema node: "root", "spec", "parallelism", "hicache", "hostPool", "modelSource", "rdma", ...


# podTemplate label and annotation keys that are the operator's: its selector labels and its prefix.
OPERATOR_LABEL_KEYS = tuple(labels.selector_labels("").keys())
OPERATOR_KEY_PREFIX = f"{labels.PREFIX}/"
_KEY_LIST = ", ".join(f"'{k}'" for k in OPERATOR_LABEL_KEYS)

RULES: tuple[Rule, ...] = (
    # ---- static errors (also enforced by the API server through CEL) ----
    Rule("name-too-long", "error",
         "metadata.name must be at most 52 characters: pod and controller-revision names append "
         "suffixes to it; choose a shorter name",
         "size(self.metadata.name) <= 52", "root"),
    Rule("name-not-dns-label", "error",
         "metadata.name must be a DNS label (lower case letters, digits and '-', starting with a letter): "
         "the Services the operator creates are named after it",
         "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')", "root"),
    Rule("host-pool-mode", "error",
         "set exactly one of hicache.hostPool.ratio, hicache.hostPool.sizeGBPerRank or "
         "hicache.hostPool.fromNodeMemory",
         "(has(self.ratio) ? 1 : 0) + (has(self.sizeGBPerRank) ? 1 : 0) + "
         "(has(self.fromNodeMemory) ? 1 : 0) == 1", "hostPool"),
    Rule("host-ratio", "error",
         "hicache.hostPool.ratio must be greater than 1 (the host pool must be larger than the "
         "device pool): raise it, or size the pool with sizeGBPerRank or fromNodeMemory",
         "!has(self.ratio) || self.ratio > 1.0", "hostPool"),
    Rule("write-back-not-allowed", "error",
         "hicache.writePolicy write_back crashes SGLang under load: use write_through or "
         "write_through_selective, or set hicache.allowWriteBack: true to accept the risk",
         "!has(self.writePolicy) || self.writePolicy != 'write_back' || "
         "(has(self.allowWriteBack) && self.allowWriteBack)", "hicache"),
    Rule("pp-with-storage", "error",
         "pipeline parallelism (parallelism.pp > 1) with an L3 storage backend is refused: set "
         "hicache.storage.backend to none or parallelism.pp to 1",
         "!(has(self.parallelism) && has(self.parallelism.pp) && self.parallelism.pp > 1) || "
         "!has(self.hicache) || !has(self.hicache.storage) || !has(self.hicache.storage.backend) || "
         "self.hicache.storage.backend == 'none'", "spec"),
    Rule("dp-divides-tp", "error",
         "parallelism.dp must divide parallelism.tp (DP attention splits the TP group of each pod): "
         "change dp to a divisor of tp",
         "(has(self.tp) ? self.tp : 1) % (has(self.dp) ? self.dp : 1) == 0", "parallelism"),
    Rule("builtin-model-needs-bundled", "error",
         "builtin:* models are served only by the bundled runtime: set engine: bundled, or set "
         "model to a Hugging Face id or a path",
         "!(has(self.engine) && self.engine == 'sglang' && "
         "(!has(self.model) || self.model.startsWith('builtin:')))", "spec"),
    Rule("bundled-model-source", "error",
         "engine bundled loads a local Hugging Face checkpoint directory: set model to an absolute "
         "path inside the pod (a mounted volume, e.g. /models/llama-3.1-8b) or to builtin:tiny / "
         "builtin:small, or keep the Hugging Face repo id and add spec.modelSource.huggingFace to "
         "download it",
         "(has(self.engine) && self.engine == 'sglang') || !has(self.model) || has(self.modelSource) || "
         "self.model.startsWith('/') || self.model in ['builtin:tiny', 'builtin:small']", "spec"),
    Rule("model-source-one-of", "error",
         "set exactly one of modelSource.huggingFace, modelSource.pvc, modelSource.hostPath or "
         "modelSource.image",
         "[has(self.huggingFace), has(self.pvc), has(self.hostPath), has(self.image)]"
         ".filter(x, x).size() == 1", "modelSource"),
    Rule("model-source-name", "error",
         "with spec.modelSource, spec.model names the model (clients send it, sizing looks its shape up): "
         "set model to its Hugging Face repo id or another name, not a path or builtin:*; the source "
         "gives the path",
         "!has(self.modelSource) || (has(self.model) && !self.model.startsWith('/') && "
         "!self.model.startsWith('builtin:'))", "spec"),
    Rule("hugging-face-repo-id", "error",
         "modelSource.huggingFace downloads spec.model, which must be a Hub repo id like "
         "Qwen/Qwen3-8B (letters, digits, '-', '_', '.'; one '/'), not a URL",
         "!has(self.modelSource) || !has(self.modelSource.huggingFace) || !has(self.model) || "
         "self.model.startsWith('/') || self.model.startsWith('builtin:') || "
         "self.model.matches('^[A-Za-z0-9][-._A-Za-z0-9]*(/[A-Za-z0-9][-._A-Za-z0-9]*)?$')", "spec"),
    Rule("bundled-parallelism", "error",
         "engine bundled runs tensor parallelism only: set parallelism.pp and parallelism.dp to 1, or use "
         "engine: sglang",
         "(has(self.engine) && self.engine == 'sglang') || !has(self.parallelism) || "
         "((!has(self.parallelism.dp) || self.parallelism.dp == 1) && "
         "(!has(self.parallelism.pp) || self.parallelism.pp == 1))", "spec"),
    Rule("pod-template-metadata", "error",
         f"podTemplate.metadata may not set the operator's labels ({', '.join(OPERATOR_LABEL_KEYS)}, "
         f"{OPERATOR_KEY_PREFIX}*) or {OPERATOR_KEY_PREFIX}* annotations: its Services, StatefulSet and rollout "
         "select and read them; use other keys",
         f"(!has(self.labels) || self.labels.all(k, !k.startsWith('{OPERATOR_KEY_PREFIX}') && !(k in [{_KEY_LIST}]))) "
         f"&& (!has(self.annotations) || self.annotations.all(k, !k.startsWith('{OPERATOR_KEY_PREFIX}')))",
         "podTemplateMetadata"),
    Rule("mooncake-master-source", "error",
         "set either hicache.storage.mooncake.masterAddress (a master that already runs) or "
         "hicache.storage.mooncake.managed (the operator runs one), not both; with managed, leave "
         "extraConfig.master_server_address unset too",
         "!(has(self.masterAddress) && has(self.managed))", "mooncake"),
    Rule("mooncake-master-ports", "error",
         "hicache.storage.mooncake.managed: rpcPort, metricsPort and httpMetadataServer.port must differ: "
         "change one of them",
         "(has(self.rpcPort) ? self.rpcPort : 50051) != (has(self.metricsPort) ? self.metricsPort : 9003) && "
         "(!has(self.httpMetadataServer) || ![has(self.rpcPort) ? self.rpcPort : 50051, "
         "has(self.metricsPort) ? self.metricsPort : 9003].exists(p, p == "
         "(has(self.httpMetadataServer.port) ? self.httpMetadataServer.port : 8080)))", "mooncakeManaged"),
    Rule("mooncake-ha-http-metadata", "error",
         "hicache.storage.mooncake.managed.ha with httpMetadataServer: each master would keep metadata of its "
         "own that the others never see; remove httpMetadataServer (clients then use P2PHANDSHAKE)",
         "!has(self.ha) || !has(self.httpMetadataServer)", "mooncakeManaged"),
    Rule("rdma-resource", "error",
         "spec.rdma.resource must be the extended resource the RDMA device plugin advertises, with its domain "
         "and outside kubernetes.io (e.g. rdma/hca_shared_devices_a)",
         "self.resource.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
         "[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$') && !self.resource.matches('^([^/]*\\\\.)?kubernetes\\\\.io/')",
         "rdma"),
    # ---- errors that need the extra config (invisible to CEL) or the nodes ----
    Rule("mooncake-master-required", "error",
         "hicache.storage.backend mooncake needs a master: set hicache.storage.mooncake.masterAddress "
         "(host:port of a mooncake_master that runs) or hicache.storage.mooncake.managed: {} (the operator "
         "runs one)"),
    Rule("mooncake-config-conflict", "error",
         "hicache.storage.mooncake.{field} ({ours!r}) and hicache.storage.extraConfig.{key} "
         "({theirs!r}) disagree: set it in one place"),
    Rule("dynamic-backend-config", "error",
         "hicache.storage.backend dynamic needs extraConfig keys backend_name, module_path and "
         "class_name; missing: {missing}"),
    Rule("unknown-model-shape", "error",
         "model {model!r} has no known shape and sizing needs its bytes per token: set "
         "spec.modelShape (numLayers, numKvHeads, headDim, dtypeBytes)"),
    Rule("no-eligible-nodes", "error",
         "no node can take a pod of this deployment (needs {gpus} nvidia.com/gpu and must match "
         "nodeSelector, required node affinity and tolerations): {why}"),
    Rule("host-pool-exceeds-node", "error",
         "host pool does not fit the node: {ranks} x {per_rank} (pools, see status.sizing) + {overhead} "
         "(processes, /dev/shm, Mooncake segment, engine reserve and slack, page cache) = {total} exceeds the "
         "allocatable memory {alloc} of node {node}: {fix}"),
    Rule("mooncake-segment-size", "error",
         "Mooncake {key} {value!r} {problem}: write {fix}"),
    Rule("file-backend-size", "error",
         "{where} {value!r} {problem}; SGLang's file backend reads bytes, or case-sensitive suffixes k, M, G, T "
         "(powers of 1000, decimals allowed) and Ki, Mi, Gi, Ti (powers of 1024, whole numbers): write {fix}"),
    Rule("engine-version-unknown", "error",
         "engine sglang: the SGLang release cannot be read from image {image!r}: set spec.engineVersion "
         "(e.g. 0.5.23) to the release the image runs"),
    Rule("engine-version-unsupported", "error",
         "SGLang {version} is older than {oldest}, the oldest release the operator supports ({why}): use an "
         "image of SGLang {oldest} or newer"),
    Rule("engine-version-feature", "error",
         "SGLang {version} lacks {what}, which this spec uses: it needs SGLang {minimum} or newer; use a newer "
         "image (and spec.engineVersion if its tag does not say the release)"),
    Rule("file-storage-dir-key", "error",
         "hicache.storage.extraConfig.storage_dir is not read by SGLang (pages would land in /tmp/hicache): "
         "name the directory file_storage_path"),
    Rule("host-pool-too-small", "error",
         "hicache.hostPool.fromNodeMemory leaves {per_rank} per rank on node {node}, below the 1 GB "
         "step of --hicache-size: raise fraction, lower reserveGiB, or use hostPool.ratio"),
    Rule("memory-request-too-small", "error",
         "resources.{which}.memory {given} is below the host pools plus overhead ({needed}): raise "
         "it, or remove it and the operator sets it"),
    Rule("max-unavailable", "error",
         "rollout.maxUnavailable must be a count of at least 1 or a percentage from 1% to 100% (0 would never "
         "let a pod be restarted or swapped): set it to e.g. 1 or '25%'",
         "!has(self.maxUnavailable) || (type(self.maxUnavailable) == int ? self.maxUnavailable >= 1 : "
         "self.maxUnavailable.matches('^([1-9][0-9]?|100)%$'))", "rollout"),
    Rule("pod-template-conflict", "error",
         "{path}: {why} (podTemplate adds to the pods the operator renders; it cannot change them)"),
    Rule("env-owned", "error",
         "env[{index}] {var} is set by the operator{source}: remove it from env"),
    Rule("extra-args-owned-flag", "error",
         "extraArgs {flag} {why}; remove it from extraArgs"),
    Rule("extra-args-unknown-flag", "error",
         "extraArgs {flag}: {why}; correct it or remove it from extraArgs"),
    Rule("extra-args-refused", "error",
         "extraArgs {flag}: {why}; remove it from extraArgs"),
    Rule("env-engine-override", "error",
         "env[{index}] {var} {why}"),
    Rule("page-size-rewritten", "error",
         "SGLang {version} serves pageSize {given} as {served} {where} (attention backend {backend}), while "
         "status, sizing and the L3 keys would say {given}: set pageSize to {served}"),
    Rule("invalid-pod-field", "error",
         "{field}: {problem} (the API server would refuse the pods' StatefulSet)"),
    Rule("schema", "error", "{detail}"),
    # ---- normalisations (SGLang rewrites these silently at boot; we say so) ----
    Rule("page-first-direct-kernel-io", "normalised",
         "memLayout page_first_direct needs the direct io backend: using ioBackend direct"),
    Rule("mooncake-layer-first", "normalised",
         "the Mooncake backend does not support layer_first: using memLayout {layout} for the {io} "
         "io backend"),
    Rule("page-first-direct-io", "normalised",
         "memLayout page_first with ioBackend direct is served as page_first_direct: using memLayout "
         "page_first_direct"),
    Rule("extra-config-local-hostname", "normalised",
         "hicache.storage.extraConfig: {paths} removed: each pod's MOONCAKE_LOCAL_HOSTNAME comes "
         "from its own address through the downward API"),
    # ---- warnings ----
    Rule("extra-config-unknown-key", "warning",
         "hicache.storage.extraConfig.{key} is not a key the {backend} backend knows; it is passed "
         "through but probably ignored (known: {known})"),
    Rule("engine-version-unchecked", "warning",
         "SGLang {version} is newer than {newest}, the newest release the operator was checked against; "
         "flags are rendered as for {newest}"),
    Rule("file-storage-not-shared", "warning",
         "the file backend writes to {path}, which is not under any extraVolumeMounts path: L3 stays inside "
         "each pod and is lost with it; mount a shared volume (e.g. a ReadWriteMany PVC) there"),
    Rule("rdma-privileged", "warning",
         "spec.rdma.privileged runs the runtime container privileged and as root, so it can register memory "
         "for RDMA whatever the node's memlock limit; where the nodes' container runtime gives containers an "
         "unlimited memlock limit, remove it"),
    Rule("rdma-without-device", "warning",
         "the Mooncake protocol is rdma but spec.rdma is unset: pods request no RDMA device and get neither "
         "IPC_LOCK nor a device; set spec.rdma.resource to the RDMA device plugin's resource"),
    Rule("write-back-allowed", "warning",
         "hicache.writePolicy write_back is allowed by allowWriteBack; SGLang has crashed under load "
         "with it (sgl-project/sglang#19212)"),
    Rule("no-eligible-nodes-yet", "warning",
         "no node can take a pod of this deployment yet (needs {gpus} nvidia.com/gpu and must match "
         "nodeSelector, required node affinity and tolerations): {why}"),
    Rule("no-memory-request", "warning",
         "pods get no memory request or limit ({why}): the scheduler cannot keep their host pools off a "
         "full node; set resources.requests.memory, or spec.modelShape and maxTotalTokens so the operator "
         "sizes it"),
    Rule("pods-per-node-memory-bound", "warning",
         "node {node} has GPUs for {by_gpus} pods of this deployment but allocatable memory for {by_memory} at "
         "{need} each, so {idle} GPUs stay idle there: lower the host pool, or use hicache.hostPool.fromNodeMemory"),
    Rule("clients-hold-pods-key", "warning",
         "engine sglang without the router: clients reach the pods with the pods' own API key, and SGLang's "
         "/server_info gives any holder of that key the admin key (which detaches and clears L3); turn the "
         "router on (router.enabled: its gate keeps the pods' key from clients), or let only trusted "
         "clients hold apiKeySecretRef's key"),
    Rule("router-cache-split", "warning",
         "router.policy cache_aware with router.replicas {replicas}: each router pod learns what every pod "
         "caches from the requests it routes itself, and the client Service spreads a conversation's turns over "
         "the router pods, so turns land on pods without their prefix; set router.replicas to 1 (a router "
         "pod routes thousands of requests a second), or choose another policy"),
    Rule("model-claim-not-shared", "warning",
         "{what} PersistentVolumeClaim {claim} has access modes {modes}, which attach it to one node, and "
         "the {replicas} pods run on {replicas} nodes: use a {needed} claim"),
    Rule("engine-page-cache-unknown", "warning",
         "SGLang {version}'s host headroom check counts the page cache of the checkpoint the ranks have just read "
         "as used, and the size of {model}'s checkpoint is not known here: raise hicache.hostPool.overheadGiB by "
         "it (else the last ranks to allocate refuse their host pools), or use SGLang {fixed} or newer, which "
         "counts page cache as free"),
    Rule("page-size-may-be-rewritten", "warning",
         "SGLang {version} may serve pageSize {given} as {served} on {gpu} GPUs (attention backend {backend}), "
         "and {why}: status, sizing and the L3 keys would then say {given}; set pageSize to {safe}, which every "
         "attention backend SGLang may pick keeps, or pin the GPU kind with nodeSelector"),
    Rule("sizing-no-longer-fits", "warning",
         "the host pool sized at the last spec change no longer fits: {why}; edit the spec to re-size "
         "or add node memory"),
)

RULES_BY_NAME = {r.name: r for r in RULES}


def rule(name: str) -> Rule:
    return RULES_BY_NAME[name]


def cel_rules(scope: str) -> list[dict[str, str]]:
    """The ``x-kubernetes-validations`` list for one schema node."""
    return [{"rule": r.cel, "message": r.message} for r in RULES if r.scope == scope and r.cel]
