#!/usr/bin/env bash
# Builds the local control plane's binaries from the Go tool modules beside this
# script into a per-version cache outside the repository. A no-op for every binary
# already present, so CI pays the cold build once per machine.
#
#   localcluster/tools/build.sh             # build what is missing, print the bin dir
#   HICACHE_BIN_CACHE=/some/dir build.sh    # choose the cache root
#
# Versions are read from the go.mod files, so bumping a version there builds a new
# cache directory and leaves the old one alone.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${HICACHE_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-operator}"
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0

modver() { # module-dir module-path -> version required in that go.mod
  awk -v m="$2" '$1==m && $2 ~ /^v/ {print $2; exit} $1=="require" && $2==m {print $3; exit}' "$here/$1/go.mod"
}

K8S_V="$(modver k8s k8s.io/kubernetes)"
ETCD_V="$(modver etcd go.etcd.io/etcd/server/v3)"
KWOK_V="$(modver kwok sigs.k8s.io/kwok)"
HELM_V="$(modver helm helm.sh/helm/v3)"
bin="$cache_root/bin-k8s-${K8S_V}-etcd-${ETCD_V}-kwok-${KWOK_V}-helm-${HELM_V}"
mkdir -p "$bin"

log() { printf '[build-cluster-bins] %s\n' "$*" >&2; }
started=$(date +%s)

build_k8s() {
  local missing=()
  for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    [[ -x "$bin/$c" ]] || missing+=("$c")
  done
  ((${#missing[@]})) || return 0
  local minor="${K8S_V#v1.}"; minor="${minor%%.*}"
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=$K8S_V -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=2025-01-01T00:00:00Z"
  done
  for c in "${missing[@]}"; do
    log "building $c $K8S_V (cold: several minutes each on 2 cores)"
    (cd "$here/k8s" && go build -trimpath -ldflags "$ld" -o "$bin/$c.tmp.$$" "k8s.io/kubernetes/cmd/$c")
    mv "$bin/$c.tmp.$$" "$bin/$c"
  done
}

build_one() { # module-dir package binary-name [ldflags]
  [[ -x "$bin/$3" ]] && return 0
  log "building $3"
  (cd "$here/$1" && go build -trimpath -ldflags "-s -w ${4:-}" -o "$bin/$3.tmp.$$" "$2")
  mv "$bin/$3.tmp.$$" "$bin/$3"
}

stage_files() {
  # KWOK ships its stage manifests in the module zip; copy them next to the binaries.
  [[ -f "$bin/stages/pod-ready.yaml" ]] && return 0
  local src
  src="$(cd "$here/kwok" && go mod download -json sigs.k8s.io/kwok@"$KWOK_V" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  mkdir -p "$bin/stages"
  cp "$src/kustomize/stage/node/fast/node-initialize.yaml" \
     "$src/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
     "$src/kustomize/stage/pod/fast/pod-ready.yaml" \
     "$src/kustomize/stage/pod/fast/pod-complete.yaml" \
     "$src/kustomize/stage/pod/fast/pod-delete.yaml" "$bin/stages/"
  chmod u+w "$bin/stages/"*
}

build_one etcd go.etcd.io/etcd/server/v3 etcd
build_one kwok sigs.k8s.io/kwok/cmd/kwok kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_V"
build_one helm helm.sh/helm/v3/cmd/helm helm "-X helm.sh/helm/v3/internal/version.version=$HELM_V"
stage_files
build_k8s

log "binaries ready in $bin ($(( $(date +%s) - started ))s)"
echo "$bin"
