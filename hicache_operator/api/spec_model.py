"""spec.modelShape and spec.modelSource: the model's KV shape when the operator does not know it,
and where the checkpoint comes from (a Hugging Face download, a PVC, a host path or an image)."""

from typing import Literal

from pydantic import ConfigDict, Field

from hicache_operator.api.spec_fields import DNS_SUBDOMAIN, SecretKeyRef, SpecModel, cel


class ModelShape(SpecModel):
    """KV geometry of the model, for bytes per token; overrides the built-in table."""

    num_layers: int = Field(ge=1, description="Transformer layers (config.json num_hidden_layers), split over pp.")
    num_kv_heads: int = Field(1, ge=1, description="KV heads (num_key_value_heads), split over tp.")
    head_dim: int = Field(1, ge=1, description="Dimension of one head.")
    dtype_bytes: int = Field(2, ge=1, description="Bytes of one KV element (2 for bfloat16 and float16).")
    mla: bool = Field(False, description="Multi-head latent attention (DeepSeek): a token's KV per layer is "
                                         "kvLoraRank + qkRopeHeadDim elements, not split over tp.")
    kv_lora_rank: int = Field(0, ge=0, description="With mla: the compressed KV's rank (kv_lora_rank).")
    qk_rope_head_dim: int = Field(0, ge=0, description="With mla: the rotary part of each key (qk_rope_head_dim).")


# A relative path inside a volume: segments that start with a letter, digit or '_' (no '..', no
# leading '/'); "" is the volume's root. An absolute path: the same segments after a '/'.
RELATIVE_PATH = r"^([A-Za-z0-9_][-._A-Za-z0-9]*(/[A-Za-z0-9_][-._A-Za-z0-9]*)*)?$"
ABSOLUTE_PATH = r"^(/[A-Za-z0-9_][-._A-Za-z0-9]*)+$"
# Files a Hugging Face download skips unless ignorePatterns says otherwise: other frameworks'
# weights and Meta's consolidated originals, none of which either engine loads.
DEFAULT_IGNORE_PATTERNS = ["original/*", "*.pth", "*.gguf", "*.onnx", "*.h5", "*.msgpack"]


class ModelClaim(SpecModel):
    """A directory on a PersistentVolumeClaim in the fleet's namespace."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                            description="The PersistentVolumeClaim (ReadWriteMany, or ReadOnlyMany for pvc, when "
                                        "replicas > 1: one pod runs per node).")
    path: str = Field("", max_length=1024, pattern=RELATIVE_PATH,
                      description="Directory inside the claim, relative to its root (empty: the root).")


class HfTokenSecretRef(SecretKeyRef):
    """One key of a Secret in the fleet's namespace."""

    key: str = Field("token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret's data.")


class HuggingFaceSource(SpecModel):
    """spec.model (a Hub repo id), downloaded once by huggingface_hub in the pods' model-download init container into a claim the fleet shares; the engine reads it offline from there."""

    revision: str = Field("main", min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_][-._/A-Za-z0-9]*$",
                          description="Branch, tag or commit. A branch is resolved at the first download and "
                                      "kept: pin a commit for fleets that must not drift.")
    token_secret_ref: HfTokenSecretRef | None = Field(
        None, description="Secret holding a Hub token (gated or private repos); given to the download as "
                          "HF_TOKEN from the Secret, never on a command line or in status.")
    endpoint: str | None = Field(None, max_length=512, pattern=r"^https?://\S+$",
                                 description="Hub endpoint (HF_ENDPOINT), e.g. an in-house mirror; unset: "
                                             "huggingface.co.")
    cache: ModelClaim = Field(description="Where the download lands, as <path>/<org>--<name>/<revision>: "
                                          "fleets and restarts that find it complete download nothing.")
    allow_patterns: list[str] | None = Field(None, description="Only files matching one of these globs; unset: "
                                                               "every file.")
    ignore_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_IGNORE_PATTERNS),
                                       description="Files matching these globs are skipped (default: "
                                                   + ", ".join(DEFAULT_IGNORE_PATTERNS) + ").")


class HostPathSource(SpecModel):
    """A checkpoint directory on the nodes themselves (read-only)."""

    path: str = Field(max_length=1024, pattern=ABSOLUTE_PATH,
                      description="The checkpoint directory on every node the pods may run on.")


class ImageSource(SpecModel):
    """A checkpoint inside an OCI image, mounted as a Kubernetes image volume (read-only)."""

    reference: str = Field(min_length=1, max_length=512, pattern=r"^\S+$",
                           description="OCI image or artifact holding the checkpoint (a Kubernetes image "
                                       "volume: the ImageVolume feature, on by default from 1.35).")
    path: str = Field("", max_length=1024, pattern=RELATIVE_PATH,
                      description="The checkpoint directory inside the image (empty: its root).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="The image volume's pull policy; unset: Kubernetes' default.")


class ModelSource(SpecModel):
    """Where the checkpoint comes from; exactly one. The engine gets it as a local --model-path and serves it as spec.model (--served-model-name)."""

    model_config = ConfigDict(json_schema_extra=cel("modelSource"))
    hugging_face: HuggingFaceSource | None = None
    pvc: ModelClaim | None = Field(None, description="A checkpoint directory on a PersistentVolumeClaim (read-only).")
    host_path: HostPathSource | None = None
    image: ImageSource | None = None
