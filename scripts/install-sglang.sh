#!/usr/bin/env bash
# Installs the real `sglang` package, CPU-importable, as the tests' oracle for what SGLang
# accepts, resolves and writes: its argument parser and resolution hooks, its storage classes.
# Each version goes into its own directory (pip --target, --no-deps) so several live side by
# side; the project's torch and transformers are reused, never SGLang's CUDA stack. Only the
# pure or small packages importing `sglang.srt.server_args` and resolving a checkpoint need
# are added, pinned, in one shared directory. Safe to run repeatedly.
#
# usage: scripts/install-sglang.sh [VENV_DIR] [VERSION...]
#   default versions: the oldest SGLang the operator supports and the newest it was checked
#   against (hicache_operator/plan/engine/versions.py: OLDEST_SUPPORTED, NEWEST_CHECKED).
# layout: $SGLANG_ORACLE_DIR (default .venv-sglang)/{deps,<version>}
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv}"
shift || true
python="$venv/bin/python"
root="${SGLANG_ORACLE_DIR:-$repo_root/.venv-sglang}"

if [[ $# -eq 0 ]]; then
  mapfile -t versions < <(cd "$repo_root" && "$python" -c \
    'from hicache_operator.plan.engine.versions import ORACLE_VERSIONS; print("\n".join(ORACLE_VERSIONS))')
else
  versions=("$@")
fi

# What `import sglang.srt.server_args` plus a full resolution on CPU asks for, beyond the
# project's own environment (torch, transformers, numpy, pydantic, fastapi, ...).
DEPS=(
  apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.0 dill==0.4.1 gguf==0.19.0
  ipython==9.18.1 loguru==0.7.3 msgspec==0.22.0 orjson==3.13.0 pillow==13.0.0
  psutil==7.2.2 pybase64==1.5.1 pyzmq==27.3.0 sentencepiece==0.2.3 torchvision==0.29.2
  traitlets==5.16.1
  # sglang 0.5.9's server_args imports its OpenAI protocol module at import time.
  distro==1.9.0 openai==2.6.1 partial-json-parser==0.2.1.1.post7 sniffio==1.3.1
)
deps_stamp="$root/deps/.stamp-$(printf '%s\n' "${DEPS[@]}" | sha256sum | cut -c1-16)"
if [[ ! -f "$deps_stamp" ]]; then
  rm -rf "$root/deps"
  "$python" -m pip install --quiet --no-deps --target "$root/deps" "${DEPS[@]}"
  touch "$deps_stamp"
fi

for v in "${versions[@]}"; do
  if [[ -f "$root/$v/.installed" ]]; then
    echo "install-sglang: sglang $v already in $root/$v"
    continue
  fi
  rm -rf "$root/$v"
  "$python" -m pip install --quiet --no-deps --target "$root/$v" "sglang==$v"
  PYTHONPATH="$root/$v:$root/deps" "$python" -c 'import sglang.srt.server_args' \
    || { echo "install-sglang: sglang $v does not import on CPU" >&2; exit 1; }
  touch "$root/$v/.installed"
  echo "install-sglang: sglang $v installed in $root/$v"
done
