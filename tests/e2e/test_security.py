"""Security of a live reconciled sample: the admin key lives only in its Secret, pods run as
non-root with no capabilities, bind to the pod IP, and the runtime in the pod demands the key."""
from __future__ import annotations

import base64
import json

import httpx
import pytest
import yaml

from hicache_operator.plan import render
from testbed import REPO
from testbed.kube import condition, kget, wait_for
from testbed.operator_proc import OperatorProcess

pytestmark = pytest.mark.e2e
NS = "security-e2e"
NAME = "sec"


@pytest.fixture(scope="module")
def live(cluster, tmp_path_factory):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    cluster.wait_established("hicachedeployments.hicache.dev")
    cluster.kubectl("create", "namespace", NS)
    op = OperatorProcess(cluster, tmp_path_factory.mktemp("operator-sec"), reconcile_interval=5).start()
    doc = yaml.safe_load((REPO / "manifests" / "samples" / "bundled-minimal.yaml").read_text())
    doc["metadata"].update(name=NAME, namespace=NS)
    doc["metadata"].setdefault("annotations", {})["hicache.dev/process-backed"] = "true"
    cluster.kubectl_apply([doc])
    wait_for(lambda: (lambda o: o if condition(o, "Ready") == "True" else None)(kget(cluster, "hcd", NAME, "-n", NS)),
             timeout=150, what="the sample Ready with a real runtime pod")
    secret = kget(cluster, "secret", f"{NAME}-admin", "-n", NS)
    key = base64.b64decode(secret["data"][render.ADMIN_SECRET_KEY]).decode()
    yield {"op": op, "key": key}
    op.stop()
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def _pods(cluster) -> list[dict]:
    return kget(cluster, "pods", "-n", NS, "-l", f"app.kubernetes.io/instance={NAME}")["items"]


def test_admin_key_lives_only_in_its_secret(cluster, live):
    key = live["key"]
    assert len(key) >= 32
    places = {
        "operator log": live["op"].log.read_text(errors="replace"),
        "events": json.dumps(kget(cluster, "events", "-n", NS)),
        "HiCacheDeployment": json.dumps(kget(cluster, "hcd", NAME, "-n", NS)),
        "StatefulSet": json.dumps(kget(cluster, "statefulset", NAME, "-n", NS)),
        "ConfigMaps": json.dumps(kget(cluster, "configmaps", "-n", NS)),
        "pods": json.dumps(_pods(cluster)),
    }
    for where, text in places.items():
        assert key not in text, f"the admin key leaks into the {where}"
        assert base64.b64encode(key.encode()).decode() not in text, f"the encoded key leaks into the {where}"
    for pod in _pods(cluster):
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["HICACHE_ADMIN_API_KEY"] == {"name": "HICACHE_ADMIN_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": f"{NAME}-admin", "key": render.ADMIN_SECRET_KEY}}}
        assert all("value" not in e or "KEY" not in e["name"] for e in c["env"])
        assert not any("api-key" in a for a in c["args"] + c["command"]), c["args"]


def test_pods_run_as_non_root_without_capabilities(cluster, live):
    for pod in _pods(cluster):
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        sc = spec["containers"][0]["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        args = spec["containers"][0]["args"]
        assert args[args.index("--host") + 1] == "$(POD_IP)" and "0.0.0.0" not in args


def test_runtime_in_the_pod_demands_the_key(cluster, live):
    if not cluster.network.endpoints_work:
        pytest.skip("pod addresses need a private network namespace (run as root)")
    ip = _pods(cluster)[0]["status"]["podIP"]
    url = f"http://{ip}:30000/hicache/storage-backend"
    assert httpx.get(url, trust_env=False).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, trust_env=False).status_code == 401
    ok = httpx.get(url, headers={"Authorization": f"Bearer {live['key']}"}, trust_env=False)
    assert ok.status_code == 200, ok.text
    with pytest.raises(httpx.ConnectError):  # bound to the pod IP, not to every address
        httpx.get("http://127.0.0.1:30000/health", trust_env=False, timeout=3)

