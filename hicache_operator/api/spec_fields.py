"""The field vocabulary every part of HiCacheDeployment.spec is written in: the base model (camelCase
aliases, unknown fields refused), enums and defaults from the flag table, CEL rules from ``rules``,
and the small types several parts share."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from hicache_operator.api import flags
from hicache_operator.api.rules import cel_rules

# Kubernetes quantities and int-or-percent values arrive as YAML ints or strings.
IntOrString = int | str
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
INT32_MAX = 2**31 - 1  # StatefulSet replicas and probe counts are int32
MAX_RANKS = 1024


def enum_of(key: str) -> Any:
    return Literal[flags.flag(key).choices]  # type: ignore[valid-type]


def from_flag(key: str, **kw: Any) -> Any:
    f = flags.flag(key)
    return Field(f.default, description=f"{f.help} ({f.cli})", **kw)


def cel(scope: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": cel_rules(scope)}


class SpecModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Resources(SpecModel):
    """A container's requests and limits: Kubernetes quantities by resource name (cpu, memory, ...)."""

    requests: dict[str, IntOrString] = Field(default_factory=dict, description=(
        "What the container is guaranteed; the scheduler places the pod where it fits."))
    limits: dict[str, IntOrString] = Field(default_factory=dict, description="The most the container may use.")



class SecretKeyRef(SpecModel):
    """One key of a Secret in the fleet's namespace."""

    # The API server's own syntax for a Secret name and a data key, so a typo is refused at apply.
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The Secret's name.")
    key: str = Field("admin-api-key", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key in the Secret's data.")


