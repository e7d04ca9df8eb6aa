"""Fuzzed HiCacheDeployment specs on the real API server, in process and against the live operator.

(a) Every generated object is refused by the API server (schema or CEL), or refused by the
operator's validation with a message that names a field, or rendered into children that the API
server accepts in a server-side dry run. No exception escapes the pure layer.
(b) A bounded batch of fuzzed objects applied for real while the operator runs: it handles every
one (ConfigValid set), logs no unhandled exception, stays alive, and still reconciles a fresh
valid sample. ``bench/fuzz_specs.py`` runs (a) at scale.
"""
from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from bench.fuzz_specs import Checker, Tally, ensure_crd, run_fuzz, spec_docs, to_bmp
from hicache_operator.io.kube import Kube
from hicache_operator.api.spec import GROUP, PLURAL, VERSION
from testbed import REPO
from testbed.kube import condition, wait_for
from testbed.operator_proc import OperatorProcess

pytestmark = pytest.mark.e2e
CI_EXAMPLES = 150
LIVE_OBJECTS = 30


@pytest.fixture(scope="module")
def api(cluster):
    ensure_crd(cluster)
    return cluster.api_client()


@pytest.fixture(scope="module")
def nodes(api):
    return [api.sanitize_for_serialization(n) for n in client.CoreV1Api(api).list_node().items]


def _namespace(cluster, name: str):
    cluster.kubectl("create", "namespace", name)
    return name


def test_fuzzed_specs_are_refused_or_render_children_the_api_server_accepts(cluster, api, nodes):
    ns = _namespace(cluster, "fuzz-specs-a")
    tally = Tally()
    try:
        run_fuzz(Checker(api, ns, nodes), CI_EXAMPLES, tally, bmp_only=True)  # astral characters: the next test
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    summary = tally.summary()
    assert tally.defects() == 0, json.dumps(summary["defect_examples"], indent=1, default=str)[:6000]
    # Both sides were exercised: specs the API server refused and specs whose children it accepted.
    # (Which refusal path a bounded random sample takes varies; test_operator.py checks every
    # operator-side rule with its own sample, and the bench runs 10,000.)
    assert summary["accepted"] > 0, summary
    assert summary["rejected_by_cel"] + summary["rejected_by_schema"] + summary["rejected_by_validation"] > 0, summary


def test_operator_apply_carries_any_unicode_text(cluster, api):
    ns = _namespace(cluster, "fuzz-specs-bmp")
    try:
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "emoji", "namespace": ns},
              "data": {"extra_config.json": '{"extra_backend_tag": "cache \U0001F680"}',
                       # refused raw by the YAML decoder, or folded to spaces in a quoted string
                       "controls": "del\x7f nel\x85 c1\x9f ls\u2028 ps\u2029 nc\ufffe\uffff tab\t cr\r"}}
        live = Kube(api).apply(cm)
        assert live["data"] == cm["data"]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _fuzzed_batch(n: int) -> list[dict]:
    docs: dict[str, dict] = {}

    @settings(max_examples=n * 3, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @given(doc=spec_docs())
    def collect(doc):
        spec = doc["spec"]
        # Keep the shared cluster light: at most two pods per object (none runs as a process).
        if not isinstance(spec.get("replicas"), int) or not 0 <= spec["replicas"] <= 2:
            spec["replicas"] = 1
        if len(docs) < n:
            docs.setdefault(doc["metadata"]["name"], to_bmp(doc))
    collect()
    return list(docs.values())


def test_live_operator_survives_fuzzed_objects(cluster, api, tmp_path):
    ns = _namespace(cluster, "fuzz-specs-live")
    custom = client.CustomObjectsApi(api)
    op = OperatorProcess(cluster, tmp_path, reconcile_interval=30).start()
    try:
        created = []
        for doc in _fuzzed_batch(LIVE_OBJECTS):
            try:
                custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, doc)
                created.append(doc["metadata"]["name"])
            except ApiException as exc:
                assert exc.status in (400, 422), exc  # refused by schema or CEL, never a server error
        assert created, "no fuzzed object got past the API server; the batch checks nothing"

        def handled():
            items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
            pending = [o["metadata"]["name"] for o in items if condition(o, "ConfigValid") not in ("True", "False")]
            return not pending or None
        wait_for(handled, timeout=120, what="ConfigValid on every fuzzed object")
        for item in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
            cond = next(c for c in item["status"]["conditions"] if c["type"] == "ConfigValid")
            assert cond["message"] or cond["status"] == "True", item["metadata"]["name"]

        sample = yaml.safe_load((REPO / "manifests" / "samples" / "bundled-minimal.yaml").read_text())
        sample["metadata"]["name"] = "after-fuzz"
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, sample)
        apps = client.AppsV1Api(api)
        wait_for(lambda: _exists(lambda: apps.read_namespaced_stateful_set("after-fuzz", ns)), timeout=90,
                 what="the fresh sample's StatefulSet")
        assert op.alive(), op.tail()
        log = op.log.read_text(errors="replace")
        assert "Traceback" not in log and "Unhandled" not in log, op.tail(120)
    finally:
        op.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _exists(read) -> bool:
    try:
        read()
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
