"""What a user sees in a terminal (issue 19): `make demo`'s numbered steps, and
push and restore as they draw their progress bars and print their results.

The commands run under a pseudo-terminal (pexpect), so the output is the
interactive one, colours and transient progress bars included, not --json.
The restore line is read off the screen and typed back, as a user would."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pexpect
import pytest

from tests.conftest import GPUSNAP, assert_continued, born, read_counter, run
from tests.integration.oci_registry import Registry, make_registry

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
BAR = "━"  # rich's progress bar


@pytest.fixture(scope="module")
def plain_registry(tmp_path_factory) -> Registry:
    reg = make_registry(tmp_path_factory.mktemp("tty-registry"), plain=True)
    yield reg
    reg.stop()


def in_terminal(command: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``command`` through bash in a 50x220 terminal: exit status, what was
    written (escapes included) and the plain text a user reads."""
    child = pexpect.spawn("bash", ["-c", command], dimensions=(50, 220), encoding="utf-8",
                          timeout=timeout, cwd=str(REPO))
    raw = child.read()  # until it exits
    child.close()
    return child.exitstatus, raw, ANSI.sub("", raw)


def test_demo_in_a_terminal_is_numbered_steps_with_the_removal_shown():
    status, _, text = in_terminal("bash packaging/demo.sh", timeout=300)
    assert status == 0, text
    steps = re.findall(r"^\[(\d+)/(\d+)\] (.*)$", text, re.M)
    assert [int(n) for n, _, _ in steps] == list(range(1, len(steps) + 1)), text
    assert {total for _, total, _ in steps} == {str(len(steps))}
    said = [line for _, _, line in steps]
    removal = next(i for i, line in enumerate(said) if line.startswith("Remove the container"))
    assert "podman rm gpusnap-demo" in said[removal] and "exited until now" in said[removal]
    push = next(i for i, line in enumerate(said) if "gpusnap migrate" in line)
    restore = next(i for i, line in enumerate(said) if "gpusnap restore" in line)
    assert push < removal < restore
    # the restore step runs the very line migrate printed
    printed = re.search(r"On the target host run:\n\s+(gpusnap restore \S+ --plain-http)\n", text)
    assert printed and said[restore].endswith(printed.group(1)), text
    assert "container gpusnap-demo: checkpointed and stopped (exited)" in text
    before, after = (int(x) for x in (re.search(r"counts in memory: at (\d+)", said[2]).group(1),
                                      re.search(r"counts on: at (\d+)", said[-1]).group(1)))
    assert after > before, (before, after)
    assert "Traceback" not in text and "Error" not in text


def test_push_then_the_printed_restore_line_in_a_terminal(plain_registry, counter):
    ref = plain_registry.ref(f"tty/c-{uuid.uuid4().hex[:8]}:v1")
    before, token = read_counter(counter), born(counter)
    status, raw, text = in_terminal(f"{GPUSNAP} push {counter} {ref} --plain-http")
    assert status == 0, text
    assert BAR in raw and ("Checkpointing " + counter in raw or "Pushing " + counter in raw), raw
    assert re.search(rf"^Pushed {re.escape(ref)} in [\d.]+ s: ", text, re.M), text
    assert f"  container {counter}: checkpointed and still running" in text
    line = re.search(r"^  restore with: (.+)$", text, re.M).group(1)
    assert f"--plain-http --name {counter}-2" in line
    assert re.search(rf"^  \(--name: {counter} exists on this host; leave it out on another host\)$",
                     text, re.M), text

    copy = f"{counter}-2"
    try:
        status, raw, text = in_terminal(line)  # typed back as printed
        assert status == 0, text
        assert BAR in raw and "Pulling " in raw, raw
        assert re.search(rf"^Restored {copy} \([0-9a-f]{{12}}\) in [\d.]+ s, running$", text, re.M)
        assert_continued(copy, before, token)
    finally:
        run(["podman", "rm", "-f", "-t", "0", copy])
