from pathlib import Path

import pytest

from tests.conftest import have_podman
from tests.integration.oci_registry import Registry, make_registry

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(item.fspath).parents]
    for item in mine:
        item.add_marker(pytest.mark.integration)
    if mine and not have_podman():
        raise pytest.UsageError("integration tests need `make install` (podman and gpusnap)")


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Registry:
    """A docker-registry (TLS + htpasswd, oci_registry.py) of the test module's own."""
    reg = make_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()
