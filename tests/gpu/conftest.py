from pathlib import Path

import pytest

from tests.gpu import harness

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # Hooks in a conftest see the whole session: mark only this folder's tests.
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            if item.get_closest_marker("timeout") is None:
                # a GPU test that hangs fails with a stack, not with a lost device call
                item.add_marker(pytest.mark.timeout(300))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # a failed GPU test says what held the disk and the memory: a full one is
    # a cause the message of the step that met it does not always name
    outcome = yield
    report = outcome.get_result()
    if report.failed and HERE in Path(item.fspath).parents:
        report.sections.append(("disk and memory", harness.room()))


@pytest.fixture
def cuda_ctr():
    """A running container with one CUDA process holding 2 GiB."""
    ctr = harness.start(nproc=1, gib=2.0)
    yield ctr
    ctr.remove()


@pytest.fixture
def cuda_ctr2():
    """A running container with two CUDA processes holding 1 GiB each."""
    ctr = harness.start(nproc=2, gib=1.0)
    yield ctr
    ctr.remove()
