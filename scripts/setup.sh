#!/usr/bin/env bash
# Sets up everything the project needs on a fresh machine; idempotent and quick when warm.
#   - a Python virtualenv in .venv with the package and its runtime/dev extras
#   - the runtime's native CPU kernels (cache_runtime/cpu_kernels, built with g++)
#   - the real Mooncake store (L3 tests) and its one system library
#   - the real `sglang` package, oldest supported and newest checked release, for the tests
#   - the embedded default checkpoint the samples, demo and e2e fleets serve (~0.5 GB)
#   - the local control plane's binaries (Go build, cached outside the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HICACHE_VENV:-.venv}"
step() { printf '\n==> %s\n' "$*"; }
t0=$(date +%s)

step "python virtualenv ($VENV)"
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
stamp="$VENV/.hicache-deps-$(sha256sum pyproject.toml | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e '.[runtime,router,dev,kernels-build]'
  touch "$stamp"
else
  echo "dependencies up to date"
fi

step "native CPU kernels for the runtime's decode path (g++; skipped when up to date)"
if command -v "${CXX:-g++}" >/dev/null; then
  "$VENV/bin/python" cache_runtime/cpu_kernels/build.py
else
  echo "no C++ compiler: the bundled runtime runs every op on torch"
fi

step "Mooncake store (real L3 backend)"
if [[ -x scripts/install-mooncake.sh ]]; then bash scripts/install-mooncake.sh "$VENV"; fi

step "real SGLang releases as test oracles (CPU import, --no-deps)"
bash scripts/install-sglang.sh "$VENV"

step "embedded default checkpoint (random-weight LlamaForCausalLM, locally trained tokenizer)"
MODELS="${HICACHE_MODELS_DIR:-$HOME/.cache/hicache-operator/models}"
"$VENV/bin/python" -m cache_runtime.synth --preset demo --out "$MODELS/demo"

step "local control plane binaries (cold build: ~20-30 min on 2 cores; cached afterwards)"
bash localcluster/tools/build.sh >/dev/null

echo
echo "setup done in $(( $(date +%s) - t0 ))s"
