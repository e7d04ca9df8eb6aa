"""Fuzzed HiCacheDeployment specs against the real API server and the operator's pure layer.

Each generated object (valid and invalid: huge numbers, unicode, missing fields, conflicting
settings, wrong types, unknown fields) must end in exactly one of:

- ``rejected_by_api``: the API server refuses the HiCacheDeployment itself (schema or CEL), or
- ``rejected_by_validation``: the API server stores it, and ``validate`` (run on the object as the
  API server stored it, defaults applied, which is what the operator reads) refuses it with a
  message that names a field, or
- ``accepted``: the operator's plan renders children and the API server accepts every one of them
  in a server-side dry run (``dryRun=All``).

Anything else is a defect: ``dry_run_failures`` (the operator would render children the API
server refuses, so it would retry forever without telling the user) and ``crashes`` (an exception
escaped the pure layer) must both be 0. ``disagreements`` lists where the CRD and ``validate``
judge the raw object differently (reported, not failures: either side may be the stricter one).

  python bench/fuzz_specs.py --examples 10000 --json-out bench/results/fuzz_specs.json

The CI test (tests/e2e/test_fuzz_specs.py) runs the same checks on fewer examples.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hicache_operator.api import flags
from hicache_operator.plan import render
from hicache_operator.io.kube import FIELD_MANAGER
from hicache_operator.control.pipeline import plan
from hicache_operator.api.rules import RULES
from hicache_operator.api.spec import GROUP, KIND, PLURAL, VERSION, HiCacheDeploymentSpec
from hicache_operator.plan.validation import validate

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------- strategies
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
BIG = st.sampled_from([0, -1, 2**31, 2**31 - 1, 2**53, 2**63 - 1, 2**63, 10**30])
SMALL_INT = st.one_of(st.integers(min_value=1, max_value=8), BIG)
UNICODE = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=20)


def _maybe_factory(junk: bool):
    """In the "junk" variant any field may also take a value of the wrong type."""
    return (lambda strategy: st.one_of(strategy, JUNK)) if junk else (lambda strategy: strategy)


NAMES = st.one_of(
    st.from_regex(r"[a-z]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True),
    st.sampled_from(["1starts-with-digit", "with.dots", "a" * 52, "b" * 53, "x" * 63, "a--b", "z"]))
IMAGES = st.one_of(st.sampled_from(["hicache-runtime:0.1.0", "lmsysorg/sglang:v0.5.5", "registry:5000/x/y@sha256:" + "a" * 64]),
                   UNICODE, st.sampled_from([" leading", "trailing ", "tab\tin", "", "x" * 600]))
MODELS = st.one_of(st.sampled_from(["builtin:tiny", "builtin:small", "meta-llama/Llama-3.1-8B-Instruct",
                                    "Qwen/Qwen2.5-7B-Instruct", "unknown/model", "builtin:nope", "/models/x",
                                    "https://huggingface.co/Qwen/Qwen3-8B", "a/b/c", "gpt2"]), UNICODE)
CLAIM_NAMES = st.sampled_from(["models", "hf-cache", "Bad_Claim", "", "a" * 300])
VOLUME_PATHS = st.sampled_from(["", "qwen", "a/b", "../up", "/abs", "a/../b", ".hidden", "x" * 1100])
MODEL_SOURCES = st.fixed_dictionaries({}, optional={
    "huggingFace": st.fixed_dictionaries({}, optional={
        "cache": st.fixed_dictionaries({}, optional={"claimName": CLAIM_NAMES, "path": VOLUME_PATHS}),
        "revision": st.sampled_from(["main", "refs/pr/1", "a" * 40, "../main", "", "v 1"]),
        "tokenSecretRef": st.fixed_dictionaries({"name": st.sampled_from(["hf", "Bad Name"])},
                                                optional={"key": st.sampled_from(["token", "bad/key"])}),
        "endpoint": st.sampled_from(["https://hub.internal", "http://10.0.0.1:8080", "ftp://x", "https:// x"]),
        "allowPatterns": st.lists(st.sampled_from(["*.json", "*.safetensors", ""]), max_size=2),
        "ignorePatterns": st.lists(st.sampled_from(["original/*", "*"]), max_size=2)}),
    "pvc": st.fixed_dictionaries({}, optional={"claimName": CLAIM_NAMES, "path": VOLUME_PATHS}),
    "hostPath": st.fixed_dictionaries({}, optional={"path": st.sampled_from(["/data/m", "rel", "/a/../b", "/"])}),
    "image": st.fixed_dictionaries({}, optional={
        "reference": st.sampled_from(["reg.local/m:v1", "", "has space"]), "path": VOLUME_PATHS,
        "pullPolicy": st.sampled_from(["Always", "Sometimes"])}),
})
QUANTITY = st.one_of(st.sampled_from(["1", "500m", "64Gi", "1Ti", "100G", "0", "2", "1e3", "abc", "-1Gi", "1.5Gi",
                                      "9999999999999999999999Ti", ""]), st.integers(-2, 2**40))
RESOURCE_NAMES = st.sampled_from(["cpu", "memory", "nvidia.com/gpu", "ephemeral-storage", "example.com/foo",
                                  "bad name", "hugepages-2Mi"])
LABEL_KEYS = st.one_of(st.sampled_from(["nvidia.com/gpu.product", "kubernetes.io/hostname", "pool", "a/b/c",
                                        "-bad", "x" * 70, "ok.example.com/" + "y" * 63]), UNICODE)
LABEL_VALUES = st.one_of(st.sampled_from(["NVIDIA-H100-80GB-HBM3", "gpu-0", "", "has space", "v" * 64, "ok_1.2"]),
                         UNICODE)
TOLERATIONS = st.sampled_from([
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"operator": "Exists"},
    {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute", "tolerationSeconds": 30},
    {"key": "dedicated", "operator": "Sometimes"},
    {"key": "dedicated", "operator": "Exists", "value": "x"},
    {"key": "", "operator": "Equal", "value": "x"},
    {"key": "k", "effect": "Never"},
    {"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule", "tolerationSeconds": 5},
    {"key": "bad key!", "operator": "Exists"},
])
AFFINITIES = st.sampled_from([
    {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}},
    {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": {"topologyKey": "topology.kubernetes.io/zone",
                                           "labelSelector": {"matchLabels": {"app": "x"}}}}]}},
    {"podAntiAffinity": []},
    {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": "x"}},
    {"nodeAffinity": "everywhere"},
])
VOLUMES = st.sampled_from([
    [{"name": "models", "hostPath": {"path": "/models"}}],
    [{"name": "cache", "emptyDir": {}}],
    [{"name": "tmp", "emptyDir": {}}],  # clashes with a volume the operator adds
    [{"name": "Bad_Name", "emptyDir": {}}],
    [{"name": "dup", "emptyDir": {}}, {"name": "dup", "emptyDir": {}}],
])
MOUNTS = st.sampled_from([
    [{"name": "models", "mountPath": "/models"}],
    [{"name": "cache", "mountPath": "/cache"}],
    [{"name": "missing", "mountPath": "/m"}],
    [{"name": "models", "mountPath": "/tmp"}],  # same path as a mount the operator adds
    [{"name": "models"}],
])
EXTRA_CONFIG = st.one_of(
    st.sampled_from([{}, {"file_storage_path": "/data/l3"}, {"master_server_address": "mc:50051"},
                     {"backend_name": "x", "module_path": "m", "class_name": "C"},
                     {"local_hostname": "node-1"}, {"protocol": "rdma"}, {"prefetch_threshold": 128},
                     {"unknown_key": [1, 2, {"deep": None}]}]),
    st.dictionaries(UNICODE, st.one_of(UNICODE, st.integers(), st.booleans(), st.none()), max_size=3))


@st.composite
def host_pools(draw, junk: bool) -> dict:
    maybe = _maybe_factory(junk)
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        out["ratio"] = draw(maybe(st.one_of(st.sampled_from([2.0, 1.0, 0.5, 1.0001, 3, 1e300]),
                                            st.floats(min_value=-10, max_value=100))))
    if draw(st.integers(0, 3)) == 0:
        out["sizeGBPerRank"] = draw(maybe(st.one_of(st.integers(1, 400), BIG)))
    if draw(st.integers(0, 3)) == 0:
        out["fromNodeMemory"] = draw(maybe(st.fixed_dictionaries({}, optional={
            "fraction": st.sampled_from([0.75, 0.8, 1.0, 0.0, 1.5, 1e-9]),
            "reserveGiB": st.sampled_from([0, 16, 32.5, -1, 1e12])})))
    if draw(st.integers(0, 4)) == 0:
        out["overheadGiB"] = draw(maybe(st.sampled_from([0, 10, 1e6, -1])))
    return out


@st.composite
def storages(draw, junk: bool) -> dict:
    maybe = _maybe_factory(junk)
    out = draw(st.fixed_dictionaries({}, optional={
        "backend": maybe(st.sampled_from(flags.STORAGE_BACKENDS + ("hf3fs",))),
        "prefetchPolicy": maybe(st.sampled_from(flags.PREFETCH_POLICIES)),
        "extraConfig": maybe(EXTRA_CONFIG),
        "mooncake": maybe(st.fixed_dictionaries({}, optional={
            "masterAddress": st.sampled_from(["mooncake-master:50051", "", "10.0.0.1:50051"]),
            "protocol": st.sampled_from(["tcp", "rdma", "udp"]),
            "metadataServer": st.sampled_from(["P2PHANDSHAKE", "http://meta:8080/metadata"]),
            "globalSegmentSize": st.sampled_from([4 * 2**30, "4gb", "lots"]),
            "localBufferSize": st.sampled_from([2**30, "512mb"]),
            "deviceName": st.sampled_from(["", "mlx5_0"])})),
    }))
    return out


@st.composite
def spec_docs(draw) -> dict:
    """A whole HiCacheDeployment manifest; ``metadata.name`` and ``spec`` are both fuzzed.

    One object in four is drawn from the "junk" variant (wrong types anywhere); the others keep
    types right so that the semantic rules, sizing and rendering get exercised too."""
    junk = draw(st.integers(0, 3)) == 0
    maybe = _maybe_factory(junk)
    spec = draw(st.fixed_dictionaries({"image": IMAGES}, optional={
        "engine": maybe(st.sampled_from(flags.ENGINES)),
        "imagePullPolicy": maybe(st.sampled_from(["Always", "IfNotPresent", "Never", "Sometimes"])),
        "model": maybe(MODELS),
        "modelSource": maybe(MODEL_SOURCES),
        "startupTimeoutSeconds": maybe(st.one_of(st.sampled_from([60, 59, 3600]), BIG)),
        "modelShape": maybe(st.fixed_dictionaries({"numLayers": SMALL_INT}, optional={
            "numKvHeads": SMALL_INT, "headDim": st.sampled_from([64, 128, 1]), "dtypeBytes": st.sampled_from([1, 2, 4]),
            "mla": st.booleans(), "kvLoraRank": st.sampled_from([0, 512]), "qkRopeHeadDim": st.sampled_from([0, 64])})),
        "replicas": maybe(st.one_of(st.integers(0, 4), BIG)),
        "parallelism": maybe(st.fixed_dictionaries({}, optional={"tp": SMALL_INT, "dp": SMALL_INT, "pp": SMALL_INT})),
        "pageSize": maybe(st.one_of(st.sampled_from([1, 16, 64]), BIG)),
        "maxTotalTokens": maybe(st.one_of(st.sampled_from([4096, 8192, 1 << 20]), BIG)),
        "enableCacheReport": maybe(st.booleans()),
        "hicache": maybe(st.fixed_dictionaries({}, optional={
            "hostPool": maybe(host_pools(junk)),
            "writePolicy": maybe(st.sampled_from(flags.WRITE_POLICIES + ("write_never",))),
            "allowWriteBack": maybe(st.booleans()),
            "ioBackend": maybe(st.sampled_from(flags.IO_BACKENDS)),
            "memLayout": maybe(st.sampled_from(flags.MEM_LAYOUTS + ("page_head",))),
            "storage": maybe(storages(junk)),
        })),
        "rollout": maybe(st.fixed_dictionaries({}, optional={
            "maxUnavailable": st.sampled_from([1, 0, "25%", "100%", "abc", "%", -1, "200%"]),
            "drainTimeoutSeconds": st.one_of(st.sampled_from([1, 300]), BIG)})),
        "resources": maybe(st.fixed_dictionaries({}, optional={
            "requests": st.dictionaries(RESOURCE_NAMES, QUANTITY, max_size=3),
            "limits": st.dictionaries(RESOURCE_NAMES, QUANTITY, max_size=3)})),
        "nodeSelector": maybe(st.dictionaries(LABEL_KEYS, LABEL_VALUES, max_size=2)),
        "tolerations": maybe(st.lists(TOLERATIONS, max_size=2)),
        "affinity": maybe(AFFINITIES),
        "hostNetwork": maybe(st.booleans()),
        "extraVolumes": maybe(VOLUMES),
        "extraVolumeMounts": maybe(MOUNTS),
        "adminKeySecretRef": maybe(st.fixed_dictionaries({"name": st.sampled_from(["my-admin", "", "Bad Name"])},
                                                         optional={"key": st.sampled_from(["k", "", "bad/key"])})),
        **({"unknownField": JUNK} if junk else {}),
    }))
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": draw(NAMES)}, "spec": spec}


# ---------------------------------------------------------------------------------- checks
def _field_words() -> set[str]:
    """Every camelCase field name of the spec (and a few object paths): an error message must name one."""
    words = {"metadata.name", "spec"}

    def walk(model) -> None:
        for name, info in model.model_fields.items():
            words.add(info.alias or name)
            ann = info.annotation
            for sub in getattr(ann, "__args__", ()) + (ann,):
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    walk(sub)
    walk(HiCacheDeploymentSpec)
    return {w for w in words if len(w) > 2}


FIELD_WORDS = _field_words()
CEL_MESSAGES = [r.message for r in RULES if r.cel]


def names_a_field(message: str) -> bool:
    return any(re.search(rf"(?<![A-Za-z]){re.escape(w)}(?![a-z])", message) for w in FIELD_WORDS)


class Checker:
    """Runs one manifest through the API server (dry run) and the operator's pure layer."""

    def __init__(self, api_client, namespace: str, nodes: list[dict]) -> None:
        from kubernetes import client
        self.api = api_client
        self.ns = namespace
        self.nodes = nodes
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)

    def _dry_run_child(self, obj: dict) -> None:
        """The operator's own write (kube.Kube.apply: server-side apply, or create for the Secret), dry run."""
        if obj["kind"] == "Secret":
            self.core.create_namespaced_secret(self.ns, obj, dry_run="All")
            return
        fn = {"StatefulSet": self.apps.patch_namespaced_stateful_set,
              "Service": self.core.patch_namespaced_service,
              "ConfigMap": self.core.patch_namespaced_config_map,
              "PodDisruptionBudget": self.policy.patch_namespaced_pod_disruption_budget}[obj["kind"]]
        fn(obj["metadata"]["name"], self.ns, obj, dry_run="All", field_manager=FIELD_MANAGER, force=True,
           _content_type="application/apply-patch+yaml")

    def check(self, doc: dict) -> dict:
        """{"outcome": ..., "detail": ...}; never raises for what the code under test does."""
        from kubernetes.client.exceptions import ApiException
        doc = json.loads(json.dumps(doc))
        doc["metadata"]["namespace"] = self.ns
        name = doc["metadata"]["name"]
        try:
            raw = validate(doc.get("spec"), name=name, nodes=self.nodes)
        except Exception:
            return {"outcome": "crash", "where": "validate(raw)", "detail": traceback.format_exc(limit=-3), "doc": doc}
        try:
            stored = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, doc, dry_run="All",
                                                                 field_validation="Strict")
        except ApiException as exc:
            if exc.status not in (400, 422):
                return {"outcome": "api_error", "detail": f"{exc.status} {exc.reason}: {exc.body}", "doc": doc}
            body = exc.body if isinstance(exc.body, str) else str(exc.body)
            kind = "rejected_by_cel" if any(m[:60] in body.replace("\\", "") for m in CEL_MESSAGES) else \
                "rejected_by_schema"
            out = {"outcome": kind, "detail": _api_message(body)}
            if raw.ok:
                out["disagreement"] = "crd-stricter"
            return out
        body = {"metadata": {"name": name, "namespace": self.ns, "uid": str(uuid.uuid4()), "generation": 1},
                "spec": stored.get("spec")}
        try:
            p = plan(body, self.nodes)
        except Exception:
            return {"outcome": "crash", "where": "plan(stored)", "detail": traceback.format_exc(limit=-3), "doc": doc}
        if not p.outcome.ok:
            errors = [f"[{f.rule}] {f.message}" for f in p.outcome.errors]
            unnamed = [e for e in errors if not names_a_field(e)]
            out = {"outcome": "rejected_by_validation", "detail": errors}
            if unnamed:
                out.update(outcome="unnamed_error", detail=unnamed, doc=doc)
            if any(r.cel and f.rule == r.name for f in p.outcome.errors for r in RULES):
                out["disagreement"] = "crd-looser-than-cel-rule"
            return out
        children = [*p.children, *render.generated_secrets(p.outcome.spec, p.owner, lambda: "fuzz-key")]
        for child in children:
            try:
                self._dry_run_child(child)
            except ApiException as exc:
                return {"outcome": "dry_run_failure", "detail": f"{child['kind']}: {_api_message(exc.body)}", "doc": doc}
        out = {"outcome": "accepted"}
        if not raw.ok:
            out["disagreement"] = "validate-stricter-on-raw"
            out["detail"] = [f"[{f.rule}] {f.message}" for f in raw.errors][:2]
        return out


def _api_message(body: Any) -> str:
    try:
        return json.loads(body)["message"]
    except (ValueError, KeyError, TypeError):
        return str(body)[:500]


DEFECTS = ("crash", "dry_run_failure", "unnamed_error", "api_error")


class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.disagreements: collections.Counter = collections.Counter()
        self.examples: dict[str, list] = collections.defaultdict(list)

    def add(self, result: dict) -> None:
        self.counts[result["outcome"]] += 1
        if "disagreement" in result:
            key = f"{result['disagreement']}: {str(result.get('detail'))[:160]}"
            self.disagreements[key] += 1
        if result["outcome"] in DEFECTS and len(self.examples[result["outcome"]]) < 20:
            self.examples[result["outcome"]].append(result)

    def defects(self) -> int:
        return sum(self.counts[d] for d in DEFECTS)

    def summary(self) -> dict:
        return {"examples": sum(self.counts.values()), "accepted": self.counts["accepted"],
                "rejected_by_cel": self.counts["rejected_by_cel"], "rejected_by_schema": self.counts["rejected_by_schema"],
                "rejected_by_validation": self.counts["rejected_by_validation"],
                "dry_run_failures": self.counts["dry_run_failure"], "crashes": self.counts["crash"],
                "unnamed_errors": self.counts["unnamed_error"], "api_errors": self.counts["api_error"],
                "disagreements": dict(self.disagreements.most_common(30)),
                "defect_examples": dict(self.examples)}


def to_bmp(obj: Any) -> Any:
    """The same object with characters beyond U+FFFF replaced (see --bmp-only)."""
    if isinstance(obj, str):
        return "".join(c if ord(c) <= 0xFFFF else "\ufffd" for c in obj)
    if isinstance(obj, dict):
        return {to_bmp(k): to_bmp(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_bmp(v) for v in obj]
    return obj


def run_fuzz(checker: Checker, examples: int, tally: Tally, *, bmp_only: bool = False) -> None:
    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @given(doc=spec_docs())
    def one(doc):
        tally.add(checker.check(to_bmp(doc) if bmp_only else doc))
    one()


def ensure_crd(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    cluster.wait_established("hicachedeployments.hicache.dev")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=10000)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--bmp-only", action="store_true",
                    help="replace characters beyond U+FFFF (Kube.apply cannot send them yet; see the report)")
    args = ap.parse_args()

    from kubernetes import client
    from localcluster import netns
    from localcluster.cluster import LocalCluster
    from localcluster.nodes import default_nodes
    netns.enter_private_netns()
    with tempfile.TemporaryDirectory(prefix="fuzz-specs-") as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", nodes=default_nodes(3, 1)).start()
        try:
            ensure_crd(cluster)
            cluster.kubectl("create", "namespace", "fuzz")
            api = cluster.api_client()
            nodes = [api.sanitize_for_serialization(n) for n in client.CoreV1Api(api).list_node().items]
            tally = Tally()
            t0 = time.monotonic()
            run_fuzz(Checker(api, "fuzz", nodes), args.examples, tally, bmp_only=args.bmp_only)
            elapsed = time.monotonic() - t0
        finally:
            cluster.stop()
    out = tally.summary()
    out["bmp_only"] = args.bmp_only
    out["seconds"] = round(elapsed, 1)
    out["examples_per_second"] = round(out["examples"] / elapsed, 1)
    print(json.dumps({k: v for k, v in out.items() if k != "defect_examples"}, indent=2))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=2, default=str))
    return 1 if tally.defects() else 0


if __name__ == "__main__":
    raise SystemExit(main())
