"""ops/restore_ref.py's edges that need no registry or Podman."""

from __future__ import annotations

import time

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.gpu.inventory import Inventory
from gpusnap.oci.registry_options import RegistryOptions
from gpusnap.ops import restore_ref


def test_a_restore_refused_before_its_plan_lets_nvmls_read_end_first(monkeypatch):
    """NVML is read in a thread beside the registry; a restore refused before
    the plan asks for it still waits for that read (bounded), so the process
    never exits with the driver's library mid-call."""
    ended = []

    def slow_read() -> Inventory:
        time.sleep(0.3)
        ended.append(True)
        return Inventory(error="no NVIDIA driver")

    def unreachable(*_a, **_k):
        raise GpusnapError("cannot reach 127.0.0.1:1", "check the address")

    monkeypatch.setattr(restore_ref, "read_inventory", slow_read)
    monkeypatch.setattr(restore_ref, "open_remote", unreachable)
    with pytest.raises(GpusnapError, match="cannot reach"):
        restore_ref.restore("127.0.0.1:1/a/b:v1", None, False, False, RegistryOptions(),
                            facts=lambda: None, use_cache=False)
    assert ended == [True]


def test_a_claimed_prepared_folder_is_let_go_where_the_restore_fails_before_podman(
        tmp_path, monkeypatch):
    """A patch's prepared folder is claimed (renamed to this restore's) before
    the parent pagemaps are fetched: a registry gone at that moment must not
    leave the claimed folder (GBs of RAM) where no eviction finds it."""
    import types

    from tests.unit.test_prepared_pages import SIZE, bundle, chunk, make_folder, pages, quarters

    old = pages(quarters("a", "b", "c", "d"))
    new = pages([*quarters("a", "b", "c"), chunk("e", SIZE // 4 + (1 << 20))])
    make_folder(tmp_path, "pre", old)

    def gone(*_a, **_k):
        raise GpusnapError("cannot reach 127.0.0.1:1", "check the address")

    monkeypatch.setattr(restore_ref, "runs_action_script", lambda runtime: True)
    monkeypatch.setattr(restore_ref, "_restoring_runtime", lambda files, default: "runc")
    monkeypatch.setattr(restore_ref.pages_aside, "enabled", lambda: True)
    monkeypatch.setattr(restore_ref.prepared_pages, "roots", lambda graph_root=None: [tmp_path])
    monkeypatch.setattr(restore_ref, "fetch_small", gone)
    remote = types.SimpleNamespace(bundle=bundle(new), client=types.SimpleNamespace(ref="r/a:b"))
    facts = types.SimpleNamespace(runtime="runc", graph_root=tmp_path)
    with pytest.raises(GpusnapError, match="cannot reach"):
        restore_ref._restore_streaming(remote, {}, 0, None, None, False, False, facts,
                                       use_cache=False)
    assert not list(tmp_path.glob("*claimed*"))


def test_a_streamed_restore_says_the_downloads_own_failure():
    # Podman fails on the stream the download cut: its words hide the cause
    from gpusnap.errors import GpusnapError
    from gpusnap.oci.tarfiles import ReaderStopped
    from gpusnap.ops.restore_ref import _why_it_failed
    podman_said = GpusnapError("podman container restore was killed")
    full = OSError(28, "No space left on device", "/run/gpusnap/ram/.gpusnap-pull-x/pages-1.img")
    assert _why_it_failed(full, podman_said) is full
    gone = GpusnapError("cannot reach registry reg.io")
    assert _why_it_failed(gone, podman_said) is gone
    assert _why_it_failed(BrokenPipeError(32, "Broken pipe"), podman_said) is podman_said
    assert _why_it_failed(ReaderStopped("Podman stopped reading"), podman_said) is podman_said
    assert _why_it_failed(None, podman_said) is podman_said


@pytest.mark.parametrize("exact, held", [(True, 8 << 30), (False, (8 + 6) << 30)])
def test_a_restore_from_pages_prepared_in_ram_holds_the_process_and_what_it_writes_anew(
        tmp_path, monkeypatch, exact, held):
    """No check chose that RAM: the hold says what this restore will take of it,
    the restored process and, patching a near match, the pages not prepared."""
    from types import SimpleNamespace

    from gpusnap.ops import restore_ref
    from gpusnap.pages import memory
    from gpusnap.pages.prepared_pages import Match

    said = []
    monkeypatch.setattr(memory, "in_ram", lambda path: True)
    monkeypatch.setattr(memory, "hold_only", said.append)
    prepared = Match(tmp_path / "prepared", exact, {}, same_bytes=2 << 30)
    remote = SimpleNamespace(bundle=SimpleNamespace(total_bytes=8 << 30))
    folder = restore_ref._pages_folder(remote, prepared)
    assert folder.parent == tmp_path and said == [held]
