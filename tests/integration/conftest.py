import pytest

from tests.conftest import have_podman


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.integration)
    if not have_podman():
        raise pytest.UsageError("integration tests need `make install` (podman and gpusnap)")
