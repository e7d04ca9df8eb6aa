"""What validation says: a finding names its rule (``api.rules``), and an outcome collects them
beside the effective spec and its sizing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from hicache_operator.api.rules import rule
from hicache_operator.api.spec import HiCacheDeploymentSpec
from hicache_operator.api.status import SizingRecord


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    message: str


def finding(name: str, **params: Any) -> Finding:
    r = rule(name)
    return Finding(name, r.severity, r.message.format(**params) if params else r.message)


@dataclass
class Outcome:
    spec: HiCacheDeploymentSpec | None  # the effective (normalised) spec; None when unparseable
    findings: list[Finding] = field(default_factory=list)
    sizing: SizingRecord | None = None

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    @property
    def errors(self) -> list[Finding]:
        return self.of("error")

    @property
    def ok(self) -> bool:
        return self.spec is not None and not self.errors


def parse(raw: dict[str, Any]) -> tuple[HiCacheDeploymentSpec | None, list[Finding]]:
    try:
        return HiCacheDeploymentSpec.model_validate(raw or {}), []
    except ValidationError as exc:
        out = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"]) or "spec"
            out.append(finding("schema", detail=f"spec.{where}: {err['msg']}"))
        return None, out
