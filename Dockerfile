# syntax=docker/dockerfile:1
# Three images from one file; every base is pinned by tag and every final stage runs as a
# non-root user with no compilers or package managers' build steps in it.
#
#   docker build --target runtime  -t ghcr.io/hicache-dev/hicache-runtime:0.1.0 .   # what GPU pods run (engine: bundled)
#   docker build --target operator -t ghcr.io/hicache-dev/hicache-operator:0.1.0 .  # the operator (no torch)
#   docker build --target router   -t ghcr.io/hicache-dev/hicache-router:0.1.0 .    # SGLang's router (spec.router.image)
#
# Releases push all three to those paths (docs/release.md), which the chart, the samples and
# spec.router.image's default use.
#
# Python pins match pyproject.toml's ranges (tests/unit/packaging checks that).

# ---- tools -------------------------------------------------------------------------------
FROM ghcr.io/astral-sh/uv:0.9.26 AS uv

# ---- runtime: build ------------------------------------------------------------------------
# CUDA 13 like torch 2.15's wheels. kernels/transfer.cu compiles here only, with the nvcc CI
# builds it with: the pinned PyPI wheels (kernels/build.py NVCC_WHEEL_PIN, pyproject.toml's
# kernels-build extra) in a venv of their own, which the final stage never copies. The devel
# base supplies the host compiler nvcc drives; its own CUDA toolkit is not used.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04 AS runtime-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=uv /uv /usr/local/bin/uv
# A self-contained CPython (python-build-standalone) under /opt/python: the final stage gets
# it with one COPY, no apt packages.
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_NO_CACHE=1 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
RUN uv python install 3.11.14 \
 && uv venv --python 3.11.14 /opt/venv \
 && uv pip install --python /opt/venv/bin/python \
      torch==2.15.0 \
      numpy==2.4.6 \
      fastapi==0.165.0 \
      uvicorn==0.54.0 \
      prometheus-client==0.26.0 \
      pydantic==2.14.3 \
      pyyaml==6.0.3 \
      safetensors==0.8.0 \
      tokenizers==0.23.3 \
      jinja2==3.1.6 \
      huggingface_hub==2.4.0
WORKDIR /opt/hicache/app
COPY kernels/ kernels/
COPY cache_runtime/ cache_runtime/
# The native CPU decode kernels (g++ from this devel base; one library with AVX2 and AVX-512
# variants, picked at load; the final image needs only libstdc++). The library checks its
# sources at load, so they stay in the image beside it.
RUN /opt/venv/bin/python cache_runtime/cpu_kernels/build.py
# Compile the transfer kernels (static cudart: the .so needs only libc/libstdc++ at load
# time) and keep them at a fixed path.
RUN uv venv --python 3.11.14 /opt/kernels-build \
 && uv pip install --python /opt/kernels-build/bin/python \
      nvidia-cuda-nvcc==13.2.86 \
      nvidia-cuda-crt==13.2.86 \
      nvidia-nvvm==13.2.86 \
      nvidia-cuda-runtime==13.2.86 \
 && HICACHE_KERNELS_CACHE=/tmp/kernels \
    HICACHE_KERNELS_NVCC=/opt/kernels-build/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc \
    /opt/kernels-build/bin/python -m kernels build \
 && install -D -m 0644 /tmp/kernels/*/libhicache_kernels.so /opt/hicache/lib/libhicache_kernels.so \
 && rm -rf /tmp/kernels /opt/kernels-build \
 && /opt/venv/bin/python -m compileall -q /opt/hicache/app
# Mooncake, the same wheel the tests run against: the runtime's mooncake L3 backend and the
# mooncake_master command a managed master runs (spec.hicache.storage.mooncake.managed, whose
# image defaults to this one). Its libraries need libibverbs (with the RDMA providers), libnuma
# and libcurl; the final stage installs nothing, so they are gathered here: the libraries ldd
# finds (glibc and the C++ runtime excepted: the final base has them) into
# /opt/hicache/lib/mooncake, the providers dereferenced into /opt/ibverbs.
# hadolint ignore=DL3008
RUN uv pip install --python /opt/venv/bin/python mooncake-transfer-engine-non-cuda==0.3.13.post1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4t64 \
 && rm -rf /var/lib/apt/lists/* \
 && M=/opt/venv/lib/python3.11/site-packages/mooncake \
 && chmod 0755 "$M/mooncake_master" \
 && mkdir -p /opt/hicache/lib/mooncake /opt/ibverbs \
 && ldd "$M/store.so" "$M/engine.so" "$M/mooncake_master" | awk '$3 ~ /^\// {print $3}' | sort -u \
    | grep -Ev '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+)\.so|/ld-linux' \
    | xargs -r cp -L -t /opt/hicache/lib/mooncake/ \
 && cp -L /usr/lib/x86_64-linux-gnu/libibverbs/*.so /opt/ibverbs/
# The embedded default checkpoint the bundled samples serve: a LlamaForCausalLM with real KV
# geometry (16 layers, 8 KV heads x 128) and random weights, plus a locally trained tokenizer.
RUN /opt/venv/bin/python -m cache_runtime.synth --preset demo --out /opt/hicache/models/demo

# ---- runtime: final ------------------------------------------------------------------------
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS runtime
RUN groupadd --gid 10001 hicache \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin hicache
COPY --from=runtime-build /opt/python /opt/python
COPY --from=runtime-build /opt/venv /opt/venv
COPY --from=runtime-build /opt/hicache /opt/hicache
COPY --from=runtime-build /opt/ibverbs /usr/lib/x86_64-linux-gnu/libibverbs
COPY --from=runtime-build /etc/libibverbs.d /etc/libibverbs.d
ENV PATH=/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/hicache/lib/mooncake \
    PYTHONPATH=/opt/hicache/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HICACHE_KERNELS_LIBRARY=/opt/hicache/lib/libhicache_kernels.so
WORKDIR /opt/hicache/app
USER 10001:10001
EXPOSE 30000
# The operator sets the command (`python -m cache_runtime serve ...`); by default, say
# which transfer backend this machine gets.
CMD ["python", "-m", "kernels", "info"]

# ---- operator: build -----------------------------------------------------------------------
FROM python:3.11.14-slim-bookworm AS operator-build
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir \
      kopf==1.45.2 \
      kubernetes==37.0.2 \
      pydantic==2.14.3 \
      httpx==0.28.1 \
      prometheus-client==0.26.0 \
      jinja2==3.1.6 \
      pyyaml==6.0.3
WORKDIR /opt/hicache/app
COPY hicache_operator/ hicache_operator/
# The KV-size formula and config.json rules the runtime allocates by (pure Python, no torch).
COPY cache_runtime/__init__.py cache_runtime/__init__.py
COPY cache_runtime/models/__init__.py cache_runtime/models/config.py cache_runtime/models/
RUN /opt/venv/bin/python -m compileall -q /opt/hicache/app

# ---- operator: final -----------------------------------------------------------------------
FROM python:3.11.14-slim-bookworm AS operator
RUN groupadd --gid 10001 hicache \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin hicache
COPY --from=operator-build /opt/venv /opt/venv
COPY --from=operator-build /opt/hicache /opt/hicache
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/hicache/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/hicache/app
USER 10001:10001
EXPOSE 8080 8081
CMD ["python", "-m", "hicache_operator", "--all-namespaces", "--liveness", "http://0.0.0.0:8081/healthz"]

# ---- router: build -------------------------------------------------------------------------
# sglang-router's wheel carries the router (Rust) and its Python launcher; aiohttp runs the client
# gate in front of it (hicache_operator/router_gate.py, one module, stdlib and aiohttp only).
FROM python:3.11.14-slim-bookworm AS router-build
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir sglang-router==0.3.2 aiohttp==3.14.5

# ---- router: final -------------------------------------------------------------------------
FROM python:3.11.14-slim-bookworm AS router
RUN groupadd --gid 10001 hicache \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin hicache
COPY --from=router-build /opt/venv /opt/venv
COPY hicache_operator/__init__.py hicache_operator/router_gate.py /opt/hicache/hicache_operator/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/hicache \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 30000 30001 29000
# The operator sets the commands: python -m sglang_router.launch_router --service-discovery ...
# (the router, on 30001) and python -m hicache_operator.router_gate (the clients' port, 30000)
CMD ["python", "-m", "sglang_router.launch_router", "--help"]
