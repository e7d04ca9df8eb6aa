"""The `helm` fixture: skips (with how to get helm) only where no helm can be found or built."""
from __future__ import annotations

import pytest
from pkg_helpers import Helm, find_helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    binary = find_helm()
    if binary is None:
        pytest.skip("no helm: set HELM, put helm on PATH, or build it with localcluster/tools/build.sh")
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))
