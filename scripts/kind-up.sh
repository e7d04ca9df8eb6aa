#!/usr/bin/env bash
# A kind cluster running hicache-operator from locally built images, for machines WITH
# Docker (the test suite itself needs neither: it uses localcluster/).
#
#   scripts/kind-up.sh            create (or reuse) the cluster, build + load the images,
#                                 advertise fake GPUs, helm install the chart
#   scripts/kind-up.sh --no-chart the same without installing the chart (for the chart e2e,
#                                 which installs its own release)
#   scripts/kind-up.sh down       delete the cluster
#
# Env: KIND_CLUSTER (hicache), KIND_NODE_IMAGE (kind's default), FAKE_GPUS per worker (8; 0
# = none), SKIP_RUNTIME_IMAGE=1 (skip the large CUDA runtime image). Needs docker, kind,
# kubectl, helm on PATH. Prints the kubeconfig to use, e.g. for
#   HICACHE_E2E_KUBECONFIG=<it> .venv/bin/python -m pytest -m e2e tests/e2e/test_helm_chart.py
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${KIND_CLUSTER:-hicache}"
FAKE_GPUS="${FAKE_GPUS:-8}"
VERSION="$(awk '/^appVersion:/ {gsub(/"/, "", $2); print $2}' charts/hicache-operator/Chart.yaml)"
# the names the chart and the samples use (the release process pushes them: docs/release.md)
OPERATOR_IMAGE="ghcr.io/hicache-dev/hicache-operator:$VERSION"
RUNTIME_IMAGE="ghcr.io/hicache-dev/hicache-runtime:$VERSION"
ROUTER_IMAGE="ghcr.io/hicache-dev/hicache-router:$VERSION"
KUBECONFIG_OUT="${XDG_CACHE_HOME:-$HOME/.cache}/hicache-operator/kind-$CLUSTER.kubeconfig"
install_chart=1

log() { printf '[kind-up] %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null || { log "$1 is not on PATH: install it first"; exit 1; }; }

case "${1:-}" in
  down) need kind; kind delete cluster --name "$CLUSTER"; rm -f "$KUBECONFIG_OUT"; exit 0 ;;
  --no-chart) install_chart=0 ;;
  "") ;;
  *) sed -n '2,15p' "$0" >&2; exit 2 ;;
esac
for tool in docker kind kubectl helm; do need "$tool"; done

if grep -qx "$CLUSTER" <<<"$(kind get clusters 2>/dev/null)"; then
  log "reusing kind cluster $CLUSTER"
else
  log "creating kind cluster $CLUSTER (1 control plane, 2 workers)"
  config="$(mktemp)"
  trap 'rm -f "$config"' EXIT
  printf '%s\n' 'kind: Cluster' 'apiVersion: kind.x-k8s.io/v1alpha4' 'nodes:' \
    '- role: control-plane' '- role: worker' '- role: worker' > "$config"
  kind create cluster --name "$CLUSTER" --config "$config" --wait 120s ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
fi
mkdir -p "$(dirname "$KUBECONFIG_OUT")"
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG_OUT"
export KUBECONFIG="$KUBECONFIG_OUT"

log "building $OPERATOR_IMAGE"
docker build --target operator -t "$OPERATOR_IMAGE" .
log "building $ROUTER_IMAGE"
docker build --target router -t "$ROUTER_IMAGE" .
images=("$OPERATOR_IMAGE" "$ROUTER_IMAGE")
if [[ "${SKIP_RUNTIME_IMAGE:-0}" != 1 ]]; then
  log "building $RUNTIME_IMAGE (CUDA base, compiles kernels/: large and slow the first time)"
  docker build --target runtime -t "$RUNTIME_IMAGE" .
  images+=("$RUNTIME_IMAGE")
fi
kind load docker-image --name "$CLUSTER" "${images[@]}"

if ((FAKE_GPUS > 0)); then
  # kind nodes have no GPUs; HiCacheDeployments ask for nvidia.com/gpu. Advertise an
  # extended resource the way Kubernetes documents it, so pods schedule and sizing sees
  # eligible nodes (the runtime then uses its CPU fallback).
  for node in $(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o name); do
    kubectl patch "$node" --subresource=status --type=json \
      -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$FAKE_GPUS\"}]" >/dev/null
  done
  log "advertised $FAKE_GPUS fake nvidia.com/gpu per worker"
fi

if ((install_chart)); then
  log "installing the chart (release hicache-operator, namespace hicache-system)"
  helm upgrade --install hicache-operator charts/hicache-operator -n hicache-system --create-namespace \
    --set image.pullPolicy=Never --wait --timeout 5m
fi
log "ready: export KUBECONFIG=$KUBECONFIG_OUT"
echo "$KUBECONFIG_OUT"
