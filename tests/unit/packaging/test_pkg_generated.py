"""Generated packaging files match their sources: the chart's CRD copy and install.yaml."""
from __future__ import annotations

import subprocess
import tomllib

import yaml
from pkg_helpers import CHART, REPO

REGENERATE = "run scripts/gen-install-manifest.sh and commit the result"


def test_chart_crds_are_a_verbatim_copy_of_crds():
    source = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    copy = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert source, "crds/ is empty"
    assert sorted(copy) == sorted(source), f"chart crds/ has {sorted(copy)}, crds/ has {sorted(source)}: {REGENERATE}"
    stale = [name for name in source if copy[name] != source[name]]
    assert not stale, f"charts/hicache-operator/crds/ differs from crds/ in {stale}: {REGENERATE}"


def test_install_manifest_is_current(helm, tmp_path):
    out = tmp_path / "install.yaml"
    subprocess.run(["bash", str(REPO / "scripts/gen-install-manifest.sh"), "--out", str(out)], check=True,
                   capture_output=True, env={**helm.env, "HELM": helm.binary}, timeout=120)
    assert out.read_text() == (REPO / "manifests/install.yaml").read_text(), \
        f"manifests/install.yaml is stale: {REGENERATE}"


def test_install_manifest_is_a_complete_cluster_wide_install():
    docs = [d for d in yaml.safe_load_all((REPO / "manifests/install.yaml").read_text()) if d]
    assert docs[0] == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "hicache-system"}}
    kinds = [d["kind"] for d in docs]
    assert kinds.index("CustomResourceDefinition") < kinds.index("Deployment")
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment"} <= set(kinds)
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd == yaml.safe_load((REPO / "crds/hicache.dev_hicachedeployments.yaml").read_text())
    for d in docs:
        if d["kind"] not in ("Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "hicache-system", d["metadata"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_chart_app_version_is_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


def test_the_default_router_image_is_the_release_one():
    """spec.router.image defaults to the router image this version's release pushes (docs/release.md)."""
    from hicache_operator.api.spec import ROUTER_IMAGE

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert ROUTER_IMAGE == f"ghcr.io/hicache-dev/hicache-router:{project['version']}"
