"""One gpusnap command at a time checkpoints a container (ops/container_busy.py):
a second one is refused in one line that names the first, by the container's
name or ID before Podman is asked; a command killed lets go with its process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.ops.container_busy import only_command, refuse_if_busy

CID = "c0ffee" * 10 + "abcd"
HOLD = ("import sys; from gpusnap.ops.container_busy import only_command\n"
        f"with only_command('{CID}', 'web', 'gpusnap push'):\n"
        "    print('held', flush=True); sys.stdin.read()\n")


@pytest.fixture
def holder(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.stdout.readline().strip() == "held"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _words(holder) -> str:
    return f"is being checkpointed by another gpusnap command (pid {holder.pid}: gpusnap push); " \
           "nothing was done"


def test_a_second_command_on_the_container_is_refused_naming_the_first(holder):
    with pytest.raises(GpusnapError) as err:
        with only_command(CID, "web", "gpusnap checkpoint"):
            pytest.fail("ran beside another command")
    assert err.value.message == f"web {_words(holder)}"
    assert "then run this again" in err.value.hint
    with only_command("0ther", "db", "gpusnap checkpoint"):  # another container: no wait
        pass


@pytest.mark.parametrize("source", ["web", CID, CID[:12]])
def test_a_busy_container_is_refused_by_name_or_id_before_podman_is_asked(holder, source):
    with pytest.raises(GpusnapError) as err:
        refuse_if_busy(source)
    assert err.value.message == f"{source} {_words(holder)}"


@pytest.mark.parametrize("source", ["webserver", "we", CID[:6], "db"])
def test_another_name_or_a_short_prefix_is_not_taken_for_it(holder, source):
    refuse_if_busy(source)


def test_a_command_killed_lets_go_with_its_process(holder):
    holder.kill()
    holder.wait()
    refuse_if_busy("web")
    with only_command(CID, "web", "gpusnap checkpoint"):
        pass
    with only_command(CID, "web", "gpusnap checkpoint"):  # and once done, the next
        pass
    refuse_if_busy(CID)
