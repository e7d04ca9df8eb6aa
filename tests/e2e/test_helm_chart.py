"""The Helm chart on a real control plane: install, reconcile a sample, RBAC, upgrade, uninstall.

By default this drives the local control plane (the `cluster` fixture) with
`processBacked=true`, so the operator pod is a real `python -m hicache_operator`
process that talks to kube-apiserver with its own ServiceAccount's token: every
permission it uses must come from the chart's RBAC. With HICACHE_E2E_KUBECONFIG set
(e.g. a kind cluster from scripts/kind-up.sh, whose images are already loaded) the
same tests run against that cluster with `kubectl` and `helm` from PATH.

The tests share one release, which fixtures move to the state each test needs (installed
watching every namespace, installed watching only APP_NS, the sample applied), so each test
passes alone and in any order; in file order the release is installed once and upgraded once.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e import helpers

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "hicache-operator"
SAMPLE = REPO / "manifests" / "samples" / "bundled-minimal.yaml"
RELEASE = "hc-e2e"
OP_NS, APP_NS, OTHER_NS = "hc-helm-op", "hc-helm-app", "hc-helm-other"
FULLNAME = f"{RELEASE}-hicache-operator"
SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=hicache-operator"
SA = f"system:serviceaccount:{OP_NS}:{FULLNAME}"
SAMPLE_NAME = yaml.safe_load(SAMPLE.read_text())["metadata"]["name"]


def wait_for(cond, timeout: float = 90, what: str = "condition", interval: float = 0.5):
    return helpers.wait_for(cond, timeout=timeout, what=what, interval=interval)


class Target:
    """kubectl and helm against the local control plane or an external kubeconfig."""

    def __init__(self, cluster=None, kubeconfig: str | None = None):
        self.cluster = cluster
        self.process_backed = cluster is not None
        self.pod_ips_reachable = cluster is not None and cluster.network.endpoints_work
        if cluster is None:
            self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        if self.cluster is not None:
            return self.cluster.kubectl(*args, check=check, input=input)
        res = subprocess.run(["kubectl", *args], env=self.env, text=True, input=input, capture_output=True,
                             timeout=120, check=False)
        if check and res.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()}")
        return res

    def helm(self, *args: str) -> subprocess.CompletedProcess:
        if self.cluster is not None:
            return self.cluster.helm(*args)
        res = subprocess.run(["helm", *args], env=self.env, text=True, capture_output=True, timeout=300, check=False)
        if res.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed: {res.stderr.strip()}")
        return res

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def exists(self, *args: str) -> bool:
        return self.kubectl("get", *args, check=False).returncode == 0

    def pod_log(self, pod: dict) -> str:
        """The operator's own output: the process log (local) or the container log."""
        meta = pod["metadata"]
        if self.cluster is None:
            return self.kubectl("logs", "-n", meta["namespace"], meta["name"], check=False).stdout
        logs = sorted((self.cluster.workdir / "pods").glob(f"{meta['namespace']}_{meta['name']}_*/container.log"))
        return logs[-1].read_text(errors="replace") if logs else ""

    def can_i(self, verb: str, resource: str, ns: str | None = None, subresource: str | None = None) -> bool:
        args = ["auth", "can-i", verb, resource, f"--as={SA}"]
        args += ["-n", ns] if ns else []
        args += [f"--subresource={subresource}"] if subresource else []
        res = self.kubectl(*args, check=False)
        assert res.stdout.strip() in ("yes", "no"), (args, res.stdout, res.stderr)
        return res.stdout.strip() == "yes"


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest):
    external = os.environ.get("HICACHE_E2E_KUBECONFIG")
    t = Target(kubeconfig=external) if external else Target(cluster=request.getfixturevalue("cluster"))
    others = t.get("deployments", "-A", "-l", "app.kubernetes.io/name=hicache-operator")["items"]
    if others:  # a second operator would reconcile the same objects
        where = ", ".join(f"{d['metadata']['namespace']}/{d['metadata']['name']}" for d in others)
        pytest.fail(f"hicache-operator already runs in this cluster ({where}): uninstall it first "
                    "(scripts/kind-up.sh --no-chart makes a cluster without it)")
    for ns in (APP_NS, OTHER_NS):
        if not t.exists("namespace", ns):  # an external cluster may keep them from an earlier run
            t.kubectl("create", "namespace", ns)
    yield t
    t.kubectl("delete", "hcd", SAMPLE_NAME, "-n", APP_NS, "--ignore-not-found", "--wait=true", "--timeout=60s",
              check=False)
    if t.kubectl("get", "deployment", FULLNAME, "-n", OP_NS, check=False).returncode == 0:
        t.helm("uninstall", RELEASE, "-n", OP_NS, "--wait")
    for ns in (APP_NS, OTHER_NS, OP_NS):
        t.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


CLUSTER_WIDE, NAMESPACED = "cluster-wide", "namespaced"
MODE_VALUES = {CLUSTER_WIDE: ["--set", "logLevel=info", "--set-json", "watchNamespaces=[]", "--set", "reconcileInterval=30"],
               NAMESPACED: ["--set", "logLevel=debug", "--set", f"watchNamespaces={{{APP_NS}}}",
                            "--set", "reconcileInterval=2"]}


class Release:
    """The chart's release RELEASE in OP_NS, as the tests left it: ``mode`` (None: not
    installed); ``install_output``: what the last `helm install` printed."""

    def __init__(self, t: Target):
        self.t = t
        self.mode: str | None = None
        self.install_output = ""

    def installed(self) -> "Release":
        """Installed in either mode (installing watches every namespace)."""
        if self.mode is None:
            t0 = time.monotonic()
            res = self.t.helm("install", RELEASE, str(CHART), "-n", OP_NS, "--create-namespace", "--wait",
                              "--timeout", "3m", *install_values(self.t), *MODE_VALUES[CLUSTER_WIDE])
            print(f"\nhelm install --wait: {time.monotonic() - t0:.1f}s")
            self.install_output, self.mode = res.stdout, CLUSTER_WIDE
        return self

    def in_mode(self, mode: str) -> "Release":
        """Installed and watching every namespace or only APP_NS; a change of mode is an upgrade
        that waits for the new operator pod to be Ready alone."""
        self.installed()
        if self.mode != mode:
            old = {p["metadata"]["name"] for p in operator_pods(self.t)}
            self.t.helm("upgrade", RELEASE, str(CHART), "-n", OP_NS, "--reuse-values", "--wait", "--timeout", "3m",
                        *MODE_VALUES[mode])
            self.mode = mode
            wait_for(lambda: (ps := operator_pods(self.t)) and len(ps) == 1 and ready(ps[0])
                     and ps[0]["metadata"]["name"] not in old, what=f"the {mode} operator pod Ready")
        return self

    def uninstall(self) -> None:
        self.t.helm("uninstall", RELEASE, "-n", OP_NS, "--wait", "--timeout", "2m")
        self.mode = None


@pytest.fixture(scope="module")
def release(target):
    yield Release(target)  # the target fixture uninstalls whatever is left


@pytest.fixture
def cluster_wide(release):
    return release.in_mode(CLUSTER_WIDE)


@pytest.fixture
def namespaced(release):
    return release.in_mode(NAMESPACED)


@pytest.fixture
def sample(target, release):
    """The sample applied in APP_NS and reconciled by the installed operator (status.conditions)."""
    release.installed()
    target.kubectl("apply", "-n", APP_NS, "-f", str(SAMPLE))
    try:
        return wait_for(lambda: (o := target.get("hcd", SAMPLE_NAME, "-n", APP_NS)).get("status", {}).get(
            "conditions") and o, what="status.conditions on the sample")
    except AssertionError as exc:
        tail = "\n".join(target.pod_log(operator_pods(target)[0]).splitlines()[-40:])
        raise AssertionError(f"{exc}\n--- operator log (last 40 lines) ---\n{tail}") from None


def operator_pods(t: Target) -> list[dict]:
    return [p for p in t.get("pods", "-n", OP_NS, "-l", SELECTOR)["items"]
            if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def install_values(t: Target) -> list[str]:
    if not t.process_backed:
        return []
    # podrunner runs the liveness probe from the process's first second (it has no
    # startupProbe), so allow a slow start on a busy machine.
    return ["--set", "processBacked=true", "--set", "livenessProbe.failureThreshold=30"]


def test_install_manifest_passes_server_side_validation(target):
    """manifests/install.yaml, every object dry-run applied by the API server (schemas, RBAC rules)."""
    created = not target.exists("namespace", "hicache-system")
    if created:  # dry-run objects need their namespace to exist
        target.kubectl("create", "namespace", "hicache-system")
    try:
        res = target.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server",
                             "--field-manager=hicache-e2e", "-f", str(REPO / "manifests" / "install.yaml"))
    finally:
        if created:
            target.kubectl("delete", "namespace", "hicache-system", "--wait=false")
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "install.yaml").read_text()) if d]
    applied = [ln for ln in res.stdout.splitlines() if "serverside-applied (server dry run)" in ln]
    assert len(applied) == len(docs), res.stdout


def test_install_runs_the_operator(target, cluster_wide):
    # NOTES.txt: what to do next, for this release.
    out = cluster_wide.install_output
    assert f"installed in namespace {OP_NS}" in out and "every namespace" in out, out
    assert f"rollout status deployment/{FULLNAME}" in out and "kubectl get hcd" in out

    pods = operator_pods(target)
    assert len(pods) == 1 and ready(pods[0]), pods
    pod = pods[0]
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "hicache_operator"]
    assert "--all-namespaces" in container["args"]
    assert pod["spec"]["serviceAccountName"] == FULLNAME
    if target.process_backed:
        assert pod["metadata"]["annotations"]["hicache.dev/process-backed"] == "true"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HICACHE_PROCESS_BACKED_PODS"] == "1"
    # kopf started and ran the operator's startup handler (which loaded its credentials).
    log = wait_for(lambda: (lg := target.pod_log(pod)) and "Activity 'configure' succeeded" in lg and lg,
                   what="kopf startup in the operator's log")
    assert "Initial authentication has finished" in log
    if target.pod_ips_reachable:  # the liveness endpoint is the real process answering at its pod IP
        r = httpx.get(f"http://{pod['status']['podIP']}:8081/healthz", timeout=5)
        assert r.status_code == 200


def test_operator_reconciles_the_sample(target, cluster_wide, sample):
    hcd = sample
    conditions = {c["type"]: c for c in hcd["status"]["conditions"]}
    assert conditions["ConfigValid"]["status"] == "True", conditions
    uid = hcd["metadata"]["uid"]
    for kind, name in (("statefulset", SAMPLE_NAME), ("service", SAMPLE_NAME), ("secret", f"{SAMPLE_NAME}-admin")):
        child = wait_for(lambda k=kind, n=name: target.exists(k, n, "-n", APP_NS) and target.get(k, n, "-n", APP_NS),
                         what=f"{kind}/{name}")
        owners = child["metadata"].get("ownerReferences") or []
        assert [(o["kind"], o["uid"], o.get("controller")) for o in owners] == [("HiCacheDeployment", uid, True)]

    if target.pod_ips_reachable:  # it was this operator pod that did it
        ip = operator_pods(target)[0]["status"]["podIP"]
        text = httpx.get(f"http://{ip}:8080/metrics", timeout=5).text
        ok = [line for line in text.splitlines()
              if line.startswith("hicache_operator_reconciles_total{") and 'result="ok"' in line]
        assert ok and sum(float(line.rsplit(" ", 1)[1]) for line in ok) >= 1, text[:2000]
    # Every API call so far was allowed: the chart's RBAC covers what this reconcile did.
    # (RBAC denials only: "is forbidden: User ... cannot ..."; a 403 for posting into a namespace
    # that another test is deleting is not about permissions.)
    forbidden = [line for line in target.pod_log(operator_pods(target)[0]).splitlines()
                 if "forbidden: User" in line and "cannot" in line]
    assert not forbidden, forbidden[:5]


# What the operator does, from hicache_operator/ and kopf: (verb, resource, subresource).
NAMESPACED_ALLOWED = [
    *((v, "hicachedeployments.hicache.dev", None) for v in ("get", "list", "watch")),
    ("patch", "hicachedeployments.hicache.dev", "status"),
    *((v, "statefulsets.apps", None) for v in ("get", "create", "patch")),
    *((v, r, None) for r in ("services", "configmaps", "poddisruptionbudgets.policy") for v in ("create", "patch")),
    *((v, "deployments.apps", None) for v in ("list", "watch", "create", "patch", "delete")),  # a managed master
    ("delete", "services", None),
    # the router: its ServiceAccount and a Role granting it what the operator holds (pods list/watch)
    *((v, r, None) for r in ("serviceaccounts", "roles.rbac.authorization.k8s.io",
                             "rolebindings.rbac.authorization.k8s.io") for v in ("create", "patch", "delete")),
    ("get", "secrets", None), ("create", "secrets", None), ("get", "persistentvolumeclaims", None),
    *((v, "pods", None) for v in ("list", "watch", "patch", "delete")),  # patch: the serving label
    ("list", "endpointslices.discovery.k8s.io", None), ("watch", "endpointslices.discovery.k8s.io", None),
    ("create", "events", None),
]
NAMESPACED_DENIED = [
    ("delete", "secrets", None), ("list", "secrets", None), ("update", "secrets", None), ("patch", "secrets", None),
    ("delete", "hicachedeployments.hicache.dev", None), ("update", "hicachedeployments.hicache.dev", None),
    ("patch", "hicachedeployments.hicache.dev", None),  # no finalizer, no annotations: only status is written
    ("create", "hicachedeployments.hicache.dev", None),
    ("delete", "statefulsets.apps", None), ("delete", "configmaps", None), ("update", "deployments.apps", None),
    ("get", "configmaps", None), ("create", "pods", None), ("create", "pods", "exec"), ("get", "pods", "log"),
    ("get", "deployments.apps", None), ("escalate", "roles.rbac.authorization.k8s.io", None),
    ("bind", "roles.rbac.authorization.k8s.io", None), ("create", "serviceaccounts", "token"),
    ("patch", "endpointslices.discovery.k8s.io", None), ("get", "services", None),
    ("patch", "pods", "status"),  # serving is a label: the operator writes no pod condition
    ("list", "persistentvolumeclaims", None), ("create", "persistentvolumeclaims", None),
    ("delete", "persistentvolumeclaims", None),  # a model cache is never the operator's to remove
]
CLUSTER_ALLOWED = [("list", "nodes", None), ("watch", "nodes", None),
                   ("list", "customresourcedefinitions.apiextensions.k8s.io", None),
                   ("watch", "customresourcedefinitions.apiextensions.k8s.io", None)]
CLUSTER_DENIED = [
    ("create", "nodes", None), ("patch", "nodes", None), ("delete", "nodes", None), ("get", "nodes", None),
    ("patch", "nodes", "status"), ("get", "namespaces", None), ("delete", "namespaces", None),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("patch", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", None),
    ("bind", "clusterroles.rbac.authorization.k8s.io", None),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    ("impersonate", "serviceaccounts", None), ("create", "certificatesigningrequests.certificates.k8s.io", None),
]


def check_can_i(t: Target, cases, ns: str | None, expect: bool) -> None:
    cases = list(cases)
    with ThreadPoolExecutor(max_workers=4) as pool:  # one kubectl process per question
        answers = list(pool.map(lambda c: t.can_i(c[0], c[1], ns, c[2]), cases))
    wrong = [c for c, answer in zip(cases, answers) if answer != expect]
    assert not wrong, f"expected {'allowed' if expect else 'denied'} in {ns or 'cluster scope'}: {wrong}"


def test_rbac_cluster_wide(target, cluster_wide):
    check_can_i(target, NAMESPACED_ALLOWED, APP_NS, True)
    check_can_i(target, NAMESPACED_ALLOWED, OTHER_NS, True)  # all namespaces
    check_can_i(target, NAMESPACED_DENIED, APP_NS, False)
    check_can_i(target, CLUSTER_ALLOWED, None, True)
    check_can_i(target, CLUSTER_DENIED + [("list", "namespaces", None)], None, False)


def test_upgrade_to_namespaced_mode_with_debug_logs(target, cluster_wide, sample):
    old = {p["metadata"]["name"] for p in operator_pods(target)}
    cluster_wide.in_mode(NAMESPACED)  # helm upgrade --reuse-values --wait, then the new pod alone and Ready
    pod = operator_pods(target)[0]
    assert pod["metadata"]["name"] not in old
    args = pod["spec"]["containers"][0]["args"]
    assert "--verbose" in args and f"--namespace={APP_NS}" in args and "--all-namespaces" not in args, args
    assert "--reconcile-interval=2" in args
    assert wait_for(lambda: "DEBUG" in target.pod_log(pod), what="debug lines in the operator's log")

    # Still reconciling, now through the Role in APP_NS: a deleted child comes back on the timer.
    target.kubectl("delete", "service", SAMPLE_NAME, "-n", APP_NS)
    svc = wait_for(lambda: target.exists("service", SAMPLE_NAME, "-n", APP_NS)
                   and target.get("service", SAMPLE_NAME, "-n", APP_NS), what="the Service re-applied")
    assert svc["metadata"]["ownerReferences"][0]["kind"] == "HiCacheDeployment"
    forbidden = [line for line in target.pod_log(pod).splitlines() if "Forbidden" in line]
    assert not forbidden, forbidden[:5]


def test_rbac_namespaced_mode(target, namespaced):
    rules = target.get("clusterrole", f"{OP_NS}-{FULLNAME}")["rules"]
    assert sorted(r for rule in rules for r in rule["resources"]) == [
        "customresourcedefinitions", "namespaces", "nodes"], rules
    check_can_i(target, NAMESPACED_ALLOWED, APP_NS, True)
    check_can_i(target, NAMESPACED_DENIED, APP_NS, False)
    # Nothing in a namespace it does not watch, not even reads.
    check_can_i(target, NAMESPACED_ALLOWED, OTHER_NS, False)
    check_can_i(target, [("create", "events", None)], OP_NS, True)  # kopf's Events about nodes
    check_can_i(target, CLUSTER_ALLOWED + [("list", "namespaces", None), ("watch", "namespaces", None)], None, True)
    check_can_i(target, CLUSTER_DENIED, None, False)


def test_uninstall_removes_the_operator(target, release, sample):
    # Delete the fleet and its children (foreground: the object goes last) while the operator
    # still runs, so nothing waits on it afterwards and a later sample starts from nothing.
    target.kubectl("delete", "hcd", SAMPLE_NAME, "-n", APP_NS, "--cascade=foreground", "--wait=true",
                   "--timeout=90s")
    release.uninstall()
    wait_for(lambda: not operator_pods(target), what="operator pod gone")
    assert not target.exists("deployment", FULLNAME, "-n", OP_NS)
    assert not target.exists("serviceaccount", FULLNAME, "-n", OP_NS)
    assert not target.exists("clusterrole", f"{OP_NS}-{FULLNAME}")
    assert not target.exists("clusterrolebinding", f"{OP_NS}-{FULLNAME}")
    assert not target.exists("role", FULLNAME, "-n", APP_NS)
    assert not target.exists("rolebinding", FULLNAME, "-n", APP_NS)
    assert not target.can_i("list", "nodes")
    # Helm leaves CRDs from crds/ in place, so uninstalling never deletes users' fleets.
    assert target.exists("crd", "hicachedeployments.hicache.dev")
