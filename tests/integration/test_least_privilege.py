"""Least privilege on the host, with the real parts: Podman + CRIU checkpoints and
exports, restores, pushes and pulls through a real registry, and containerd shim
tasks leave folders 0700 and files 0600 (sockets 0600); and a container's
environment and the registry password never show in any output, the journal, the
registry's manifest or the checkpoint's config."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import (COUNTER, DEMO_IMAGE, GPUSNAP, assert_continued, born, gpusnap_json,
                            podman, read_counter, run, wait_counter)
from tests.integration.oci_registry import PASSWORD, Registry
from tests.integration.shim_containerd import ctr_checkpoint, private_containerd, remove, run_counter, tasks
from tests.integration.shim_containerd import wait_counter as shim_wait_counter

STATE = Path("/run/gpusnap")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def private_tree(root: Path) -> dict[str, int]:
    """Every folder, file, FIFO and socket under ROOT (itself too) that is not 0700 / 0600."""
    wrong = {}
    for dirpath, dirs, files in os.walk(root):
        if mode(Path(dirpath)) != 0o700:
            wrong[dirpath] = mode(Path(dirpath))
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink() and mode(p) != 0o600:
                wrong[str(p)] = mode(p)
    return wrong


def _descendants_cmdlines(root: int) -> str:
    """The command lines of ROOT and every process below it, joined."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    ours, todo = [], [root]
    while todo:
        pid = todo.pop()
        ours.append(pid)
        todo += children.get(pid, [])
    lines = []
    for pid in ours:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return "\n".join(lines)


class Watch:
    """Runs a command and records, while it runs, the modes of its staging folders
    (and all in them) and partial exports: they are gone once it has finished.

    Folders in MINE are this test's alone: all there is the command's. In SHARED
    (beside Podman's storage, /var/tmp) other runs stage too: a `.gpusnap-*`
    entry there counts once a process of the command names it (Podman's
    --export/--import, the FIFO pump's arguments)."""

    def __init__(self, mine: list[Path], shared: list[Path] = ()) -> None:
        self.mine = [f for f in mine if f.is_dir()]
        self.shared = [f for f in shared if f.is_dir()]
        self.seen: dict[str, tuple[int, bool]] = {}  # path: (mode, is a folder)
        self._ours: set[Path] = set()
        self._others: set[Path] = set()  # there before the command started
        self._stop = threading.Event()
        self.pid = 0

    def _look(self, path: Path) -> None:
        try:
            st = os.lstat(path)
            self.seen[str(path)] = (stat.S_IMODE(st.st_mode), stat.S_ISDIR(st.st_mode))
            if stat.S_ISDIR(st.st_mode):
                for sub in path.iterdir():
                    self._look(sub)
        except OSError:
            pass  # removed meanwhile

    @staticmethod
    def _candidates(folder: Path) -> list[Path]:
        try:
            return [folder / n for n in os.listdir(folder)
                    if n.startswith(".gpusnap-") or n.endswith(".partial")]
        except OSError:
            return []

    def _watch(self) -> None:
        while not self._stop.is_set():
            for folder in self.mine:
                for path in self._candidates(folder):
                    self._look(path)
            unknown = [p for f in self.shared for p in self._candidates(f)
                       if p not in self._ours and p not in self._others]
            if unknown:
                cmdlines = _descendants_cmdlines(self.pid)
                self._ours.update(p for p in unknown if f"{p}/" in cmdlines or f"{p} " in cmdlines)
            for path in list(self._ours):
                self._look(path)
            time.sleep(0.02)

    def run(self, cmd: list[str], stdin: str = "") -> subprocess.CompletedProcess:
        self._others = {p for f in self.shared for p in self._candidates(f)}
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.pid = proc.pid
        thread = threading.Thread(target=self._watch, daemon=True)
        thread.start()
        try:
            out, err = proc.communicate(stdin)
        finally:
            self._stop.set()
            thread.join()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def wrong(self) -> dict[str, str]:
        """Folders not 0700, files (FIFOs too) not 0600."""
        return {p: oct(m) for p, (m, is_dir) in self.seen.items() if m != (0o700 if is_dir else 0o600)}


def watched(cmd: list[str], mine: list[Path], shared: list[Path] = (),
            stdin: str = "") -> tuple[dict, Watch]:
    """CMD (a gpusnap --json command) run under a Watch: (its JSON result, the watch)."""
    watch = Watch(mine, shared)
    res = watch.run([*cmd, "--json"], stdin)
    assert res.returncode == 0, (cmd, res.stdout, res.stderr)
    return json.loads(res.stdout), watch


def shared_staging() -> list[Path]:
    """Where gpusnap stages: beside Podman's storage, or /var/tmp."""
    root = run(["podman", "info", "--format", "{{.Store.GraphRoot}}"], check=True).stdout.strip()
    return [Path(root).parent, Path("/var/tmp")]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """TMPDIR of the commands: where `gpusnap restore FILE` makes its import FIFO."""
    d = tmp_path / "tmpdir"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(d))
    return d


def state_files_since(t0: float) -> dict[str, int]:
    """/run/gpusnap folders, and the files written since T0, that are not 0700 / 0600.
    (Other runs share the folder: their older files are not this test's.)"""
    wrong = {}
    for dirpath, dirs, files in os.walk(STATE):
        d = Path(dirpath)
        # /run/gpusnap/shim: the shim test uses a containerd and a shim folder of its own
        if d.name != "shim" and mode(d) != 0o700:
            wrong[dirpath] = mode(d)
        for name in files:
            p = d / name
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_mtime >= t0 - 1 and not stat.S_ISSOCK(st.st_mode) and mode(p) != 0o600:
                wrong[str(p)] = mode(p)
    return wrong


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A chunk cache an older gpusnap made readable to all: gpusnap narrows it on use."""
    d = tmp_path / "cache" / "chunks"
    d.mkdir(parents=True, mode=0o755)
    d.chmod(0o755)
    monkeypatch.setenv("GPUSNAP_CACHE_DIR", str(d))
    return d


def gs(*args: str) -> subprocess.CompletedProcess:
    """gpusnap with the registry password on stdin; output kept for the secret checks."""
    return run([GPUSNAP, *args], input=PASSWORD + "\n")


def unique_ref(registry: Registry) -> str:
    return registry.ref(f"ckpt/lp-{uuid.uuid4().hex[:8]}:v1")


# --- Podman: checkpoint, export, restore ------------------------------------------------


def test_checkpoint_export_restore_leave_only_root_readable_files(counter, tmp_path, private_tmp):
    t0 = time.time()
    export = tmp_path / "ctr.tar.zst"
    export.write_text("an older export, readable by all")
    export.chmod(0o644)
    _, watch = watched([GPUSNAP, "checkpoint", counter, "--export", str(export)], [tmp_path])
    assert mode(export) == 0o600
    assert any(".gpusnap-fifo-" in p for p in watch.seen), watch.seen  # the watch saw the FIFO
    assert any(p.endswith(".partial") for p in watch.seen), watch.seen
    assert watch.wrong() == {}, watch.seen

    podman("rm", counter)
    restored, watch = watched([GPUSNAP, "restore", str(export)], [private_tmp])
    assert restored["container"]["status"] == "running"
    assert any(".gpusnap-fifo-" in p for p in watch.seen), watch.seen
    assert watch.wrong() == {}, watch.seen
    assert state_files_since(t0) == {}
    journal = STATE / "journal.jsonl"
    assert mode(journal) == 0o600 and journal.stat().st_mtime >= t0 - 1
    assert mode(STATE) == 0o700


def test_a_local_checkpoint_is_root_only(counter):
    before, token = read_counter(counter), born(counter)
    gpusnap_json("checkpoint", counter)
    userdata = Path(podman("inspect", counter, "--format", "{{.StaticDir}}").stdout.strip())
    ckpt = userdata / "checkpoint"
    assert mode(userdata) == 0o700  # Podman's own
    assert ckpt.is_dir()
    # runc makes checkpoint/ 0600 and CRIU its images 0644: gpusnap takes group and others away
    open_to_others = {str(p): mode(p) for p in [ckpt, *ckpt.rglob("*")]
                      if not p.is_symlink() and mode(p) & 0o077}
    assert open_to_others == {}
    gpusnap_json("restore", counter)
    assert_continued(counter, before, token)


# --- a registry: push, pull, restore ---------------------------------------------------


def test_push_pull_restore_cache_and_staging_are_root_only(registry, counter, cache_dir, tmp_path,
                                                           private_tmp):
    ref = unique_ref(registry)
    t0 = time.time()
    flags = registry.flags()
    pushed, watch = watched([GPUSNAP, "push", counter, ref, "--stop", *flags], [tmp_path], shared_staging(),
                            PASSWORD + "\n")
    assert pushed["source_kind"] == "container"
    assert any(".gpusnap-" in p for p in watch.seen), watch.seen  # the push staged its checkpoint
    assert watch.wrong() == {}, watch.seen
    # the cache: narrowed from 0755, every folder 0700, every blob and index entry 0600
    assert any(cache_dir.rglob("*")) and private_tree(cache_dir) == {}

    for name, extra in (("pulled.tar.zst", []), ("pulled.tar", ["--no-cache"])):
        _, watch = watched([GPUSNAP, "pull", ref, "-o", str(tmp_path / name), *extra, *flags],
                           [tmp_path], stdin=PASSWORD + "\n")
        assert mode(tmp_path / name) == 0o600
        assert any(p.endswith(".partial") for p in watch.seen) and watch.wrong() == {}, watch.seen

    podman("rm", counter)
    restored, watch = watched([GPUSNAP, "restore", ref, *flags], [tmp_path, private_tmp],
                              shared_staging(), PASSWORD + "\n")
    assert restored["container"]["status"] == "running"
    assert any(".gpusnap-pull-" in p for p in watch.seen), watch.seen
    assert watch.wrong() == {}, watch.seen
    assert private_tree(cache_dir) == {}
    assert state_files_since(t0) == {}


# --- containerd: the shim's socket folder, sockets and info files ------------------------


def test_shim_sockets_and_info_files_are_root_only():
    with private_containerd() as c:
        c.shim_dir.mkdir(mode=0o711)  # as an older gpusnap made it
        c.shim_dir.chmod(0o711)
        run_counter(c, "lp1")
        deadline = time.monotonic() + 20
        while c.zygote_pid() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.zygote_pid() is not None
        run_counter(c, "lp2")  # served by a fork of the zygote (unless the code just changed)
        assert len(c.shim_servers()) == 2
        names = sorted(p.name for p in c.shim_dir.iterdir())
        assert "zygote.sock" in names and "zygote.json" in names and "zygote.lock" in names
        assert sum(n.endswith(".sock") for n in names) == 3, names
        assert mode(c.shim_dir) == 0o700
        wrong = {n: oct(mode(c.shim_dir / n)) for n in names if mode(c.shim_dir / n) != 0o600}
        assert wrong == {}
        for info in c.shim_servers().values():
            assert mode(Path(info["bundle"]) / "address") == 0o600

        # a checkpoint restored through the shim: CRIU's work folder in the bundle is 0700
        ctr_checkpoint(c, "lp1", "localhost/lp1:ckpt")
        remove(c, "lp1")
        c.ctr("containers", "restore", "--live", "--rw", "lp1", "localhost/lp1:ckpt")
        pid = tasks(c)["lp1"][0]
        shim_wait_counter(c, "lp1", int(Path(f"/proc/{pid}/root/tmp/c").read_text()))
        bundle = Path(c.server_of("lp1")["bundle"])
        assert mode(bundle / "criu-work") == 0o700
        assert mode(bundle / "gpusnap-shim.json") == 0o600
        for task in ("lp1", "lp2"):
            remove(c, task)


# --- secrets: the container's environment, the registry password ----------------------


def test_container_environment_and_password_never_show(registry, name, cache_dir, tmp_path):
    secret = f"tok-{uuid.uuid4().hex}"
    podman("run", "-d", "--name", name, "--network", "none", "-e", f"SECRET_TOKEN={secret}",
           DEMO_IMAGE, "sh", "-c", COUNTER)
    wait_counter(name, 3)
    assert secret in podman("exec", name, "sh", "-c", "echo $SECRET_TOKEN").stdout  # it is there
    journal = STATE / "journal.jsonl"
    journal_start = journal.stat().st_size if journal.exists() else 0
    outputs = []

    def out(res) -> dict:
        outputs.append(res.stdout + res.stderr)
        assert res.returncode == 0, (res.args, res.stdout, res.stderr)
        return json.loads(res.stdout)

    export = tmp_path / "env.tar.zst"
    out(run([GPUSNAP, "checkpoint", name, "--export", str(export), "--leave-running", "--json"]))
    info = out(run([GPUSNAP, "inspect", str(export), "--json"]))
    assert info["container"]["name"] == name
    ref = unique_ref(registry)
    pushed = out(gs("push", str(export), ref, *registry.flags(), "--json"))
    remote = out(gs("inspect", ref, *registry.flags(), "--json"))
    assert remote["registry"]["digest"] == pushed["digest"]
    pulled = tmp_path / "pulled.tar.zst"
    out(gs("pull", ref, "-o", str(pulled), *registry.flags(), "--json"))
    out(run([GPUSNAP, "inspect", str(pulled), "--json"]))
    out(gs("push", name, unique_ref(registry), "--leave-running", *registry.flags(), "--json"))
    out(run([GPUSNAP, "checkpoint", name, "--json"]))  # a local one, inspected by name
    out(run([GPUSNAP, "inspect", name, "--json"]))
    failed = gs("push", str(export), f"gpusnap:{PASSWORD}@{registry.host}/ckpt/x:v1", "--json")
    assert failed.returncode != 0
    outputs.append(failed.stdout + failed.stderr)

    # what the registry holds besides the chunks: the manifest and the checkpoint's config
    flags = registry.oras_flags()
    manifest = run(["oras", "manifest", "fetch", *flags, ref], check=True).stdout
    config = json.loads(manifest)["config"]["digest"]
    blob = run(["oras", "blob", "fetch", *flags, "--output", "-",
                f"{ref.rsplit(':', 1)[0]}@{config}"], check=True).stdout
    bundle = json.loads(blob)
    assert bundle["summary"]["container"]["name"] == name and bundle["gpu_manifest"] is None

    with open(journal, "rb") as f:
        f.seek(journal_start)
        journaled = f.read().decode(errors="replace")
    for where, text in [*enumerate(outputs), ("journal", journaled), ("manifest", manifest),
                        ("config", blob)]:
        assert secret not in text, where
        assert PASSWORD not in text, where
    assert "SECRET_TOKEN" not in blob and "SECRET_TOKEN" not in "".join(outputs)
