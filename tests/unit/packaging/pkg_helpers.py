"""Shared by the packaging tests: paths, and helm found as $HELM, on PATH, or built by localcluster/tools/build.sh."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "hicache-operator"


def find_helm() -> str | None:
    explicit = os.environ.get("HELM") or shutil.which("helm")
    if explicit:
        return explicit
    try:
        out = subprocess.run(["bash", str(REPO / "localcluster/tools/build.sh")], check=True, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=1800).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    helm = Path(out.strip().splitlines()[-1]) / "helm"
    return str(helm) if helm.is_file() else None


class Helm:
    def __init__(self, binary: str, home: Path):
        self.binary = binary
        self.env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}
        self._cache: dict[tuple, list[dict]] = {}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([self.binary, *args], env=self.env, text=True, capture_output=True, timeout=120,
                             check=False)
        if check and res.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed ({res.returncode}):\n{res.stderr}")
        return res

    def template_args(self, *sets: str, namespace: str = "hicache-system", release: str = "hc") -> list[str]:
        args = ["template", release, str(CHART), "--namespace", namespace]
        for s in sets:
            args += ["--set", s]
        return args

    def render(self, *sets: str, namespace: str = "hicache-system", release: str = "hc") -> list[dict]:
        """The chart's objects for these `--set` values (CRDs excluded, as `helm template` does)."""
        key = (sets, namespace, release)
        if key not in self._cache:
            out = self.run(*self.template_args(*sets, namespace=namespace, release=release)).stdout
            self._cache[key] = [d for d in yaml.safe_load_all(out) if d]
        return self._cache[key]

    def render_error(self, *sets: str) -> str:
        res = self.run(*self.template_args(*sets), check=False)
        assert res.returncode != 0, f"expected helm template to fail for {sets}"
        return res.stderr


def only(objs: list[dict], kind: str, name: str | None = None, namespace: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
             and (namespace is None or o["metadata"].get("namespace") == namespace)]
    assert len(found) == 1, f"expected one {kind} {name or ''} {namespace or ''}, got {len(found)}"
    return found[0]
