"""Podman, driven through its CLI.

The CLI rather than podman-py's REST client: checkpoint/restore with
--export/--import are CLI-side operations in Podman 4.x, the CLI needs no
`podman system service` running, and its error text is what users know.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from datetime import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from gpusnap import journal, waits
from gpusnap.errors import GpusnapError
from gpusnap.private import write_private
from gpusnap.procs import process_tree
from gpusnap.runtime.kept_checkpoint import CHECKPOINT_DIRS, CHECKPOINT_FILES
from gpusnap.waits import Bound

T = TypeVar("T")


@dataclass
class Container:
    id: str
    name: str
    status: str  # running, exited, paused, created, ...
    pid: int
    image: str
    checkpointed: bool
    userdata: Path  # the bundle dir; CRIU writes into userdata/checkpoint
    devices: list[str]
    runtime: str = ""  # its OCI runtime (runc, crun): which CRIU configuration it hands on
    hostname_path: str = ""  # Podman's /etc/hostname and /etc/hosts for it, on the host
    hosts_path: str = ""
    lower_dirs: tuple[str, ...] = ()  # its image's layers on the host, uppermost first (overlay)
    created: str = ""  # when Podman made it (RFC 3339, as inspect says)

    @property
    def running(self) -> bool:
        return self.status == "running"

    def made_before(self, when: float) -> bool:
        """Whether Podman made it before ``when`` (epoch seconds); False where unknown."""
        # Podman: 2026-12-01T18:26:21.092364953Z; nanoseconds and Z are beyond
        # Python 3.10's fromisoformat
        stamp = re.sub(r"(\.\d{6})\d+", r"\1", self.created.strip()).replace("Z", "+00:00")
        try:
            return datetime.fromisoformat(stamp).timestamp() < when
        except ValueError:
            return False

    @property
    def checkpoint_dir(self) -> Path:
        return self.userdata / "checkpoint"

    @property
    def graph_root(self) -> Path:
        """The storage holding it: userdata is GRAPHROOT/DRIVER-containers/ID/userdata."""
        return self.userdata.parents[2]


def podman_binary() -> str:
    path = shutil.which("podman")
    if path is None:
        raise GpusnapError("podman is not installed", "install Podman 4.x (make deps)")
    return path


def _run(args: list[str], bound: Bound | None = None,
         watch: Callable[[], None] | None = None,
         progress: Callable[[], int] | None = None) -> subprocess.CompletedProcess:
    """Podman, ended by ``bound`` (a query's when None): never an endless wait.
    A checkpoint or restore at its bound ends with the runc and CRIU it ran."""
    bound = bound or Bound.of("PODMAN")
    # runc and CRIU are Podman's for a checkpoint; a restore's are conmon's, which
    # Podman double-forks: they may go on
    stopped = "Podman and the runc and CRIU it ran were" if bound.name == "PODMAN_CHECKPOINT" \
        else "Podman was"
    hint = None if bound.name == "PODMAN" else \
        (f"{stopped} stopped; `gpusnap doctor` checks what they left; if the host is just "
         f"slow, raise the bound ({waits.raise_words(bound.name)})")
    return waits.run([podman_binary(), *args], f"podman {' '.join(args[:2])}", bound, watch,
                     hint=hint, progress=progress,
                     tree=None if bound.name == "PODMAN" else _descendants)


def _descendants(pid: int) -> list[int]:
    """What Podman started in its own session: not a guardian CRIU's action
    script started in a session of its own (setsid) to outlive the dump."""
    try:
        session = os.getsid(pid)
    except OSError:
        return []
    below = []
    for child in process_tree(pid)[1:]:
        with contextlib.suppress(OSError):
            if os.getsid(child) == session:
                below.append(child)
    return below


# How runc passes on the words of a hook that failed (gpusnap's OCI hook among them)
_HOOK_SAID = ", stderr: gpusnap: "


def _last_error(stderr: str) -> str:
    """Podman's own last line, without the 'Error: ' prefix; where it is a
    refusal of gpusnap's OCI hook, the hook's own words, not runc's wrapping
    ("OCI runtime error: runc: error running hook #0: … stderr: gpusnap: …")."""
    lines = [l.strip() for l in stderr.strip().splitlines() if l.strip()]
    line = lines[-1] if lines else "podman failed"
    if _HOOK_SAID in line:
        return "gpusnap's OCI hook: " + line.split(_HOOK_SAID, 1)[1]
    return line.removeprefix("Error: ").removeprefix("error: ")


def inspect(name: str) -> Container:
    found = find(name)
    if found is None:
        raise GpusnapError(f"no such container: {name}", "list containers with `podman ps -a`")
    return found


def find(name: str) -> Container | None:
    """The container, or None when Podman has none of that name (one call, where
    `exists` then `inspect` would make two)."""
    res = _run(["container", "inspect", name])
    if res.returncode != 0:
        if "no such container" in res.stderr.lower():
            return None
        raise GpusnapError(f"podman container inspect {name}: {_last_error(res.stderr)}")
    data = json.loads(res.stdout)[0]
    state = data.get("State", {})
    bundle = data.get("StaticDir") or ""
    return Container(
        id=data["Id"], name=data["Name"], status=state.get("Status", "unknown"),
        pid=int(state.get("Pid") or 0), image=data.get("ImageName") or data.get("Image", ""),
        checkpointed=bool(state.get("Checkpointed")),
        userdata=Path(bundle),
        devices=[d.get("PathInContainer", "") for d in data.get("HostConfig", {}).get("Devices") or []],
        runtime=data.get("OCIRuntime") or "",
        hostname_path=data.get("HostnamePath") or "", hosts_path=data.get("HostsPath") or "",
        lower_dirs=tuple(d for d in ((data.get("GraphDriver") or {}).get("Data") or {})
                         .get("LowerDir", "").split(":") if d),
        created=data.get("Created") or "",
    )


def answer(args: list[str]) -> str:
    """What a Podman query printed; "" where it failed or did not answer in time."""
    try:
        res = _run(args)
    except waits.WaitExpired:
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def info() -> dict:
    """`podman info` as JSON; {} where it failed or did not answer in time."""
    try:
        return json.loads(answer(["info", "--format", "json"]) or "{}")
    except ValueError:
        return {}


def default_runtime() -> str:
    """The OCI runtime Podman uses when none is named ("runc", "crun"); "" if unknown."""
    try:
        return host_facts().runtime
    except GpusnapError:  # not installed
        return ""


def version() -> str:
    """The Podman client's version ("4.3.1"), "" when it cannot be told."""
    return answer(["version", "--format", "{{.Client.Version}}"])


@dataclass(frozen=True)
class HostFacts:
    """What a restore asks Podman about this host, in one `podman info`."""
    version: str  # "4.3.1"; "" where Podman did not answer
    runtime: str  # the default OCI runtime's name ("runc", "crun"); ""
    graph_root: Path | None  # /var/lib/containers/storage for root


def host_facts() -> HostFacts:
    """Blank where Podman does not answer; GpusnapError where it is not installed.

    `podman info` counts the containers by state, which takes each one's lock:
    asked while another container's restore or checkpoint ran, it waited for
    that to end. Its answer is kept (state_dir()/podman-facts.json) while
    Podman's version (`podman version` takes no lock) and the files that set
    its runtime and storage are as they were."""
    key = _facts_key()
    kept = _kept_facts(key) if key else None
    if kept is not None:
        return kept
    facts = _asked_facts()
    if key and facts.version and facts.runtime and facts.graph_root:
        _keep_facts(key, facts)
    return facts


def _asked_facts() -> HostFacts:
    try:
        res = _run(["info", "--format",
                    "{{.Version.Version}}\t{{.Host.OCIRuntime.Name}}\t{{.Store.GraphRoot}}"])
    except (OSError, waits.WaitExpired):  # it could not be run, or did not answer
        return HostFacts("", "", None)
    fields = res.stdout.rstrip("\n").split("\t") if res.returncode == 0 else []
    if len(fields) != 3:
        return HostFacts("", "", None)
    return HostFacts(fields[0].strip(), fields[1].strip(),
                     Path(fields[2].strip()) if fields[2].strip() else None)


# What sets Podman's default runtime and its storage (containers.conf(5),
# containers-storage.conf(5)): a file, a drop-in folder, or one an environment
# variable names.
CONFIGS = ("/usr/share/containers/containers.conf", "/etc/containers/containers.conf",
           "/usr/share/containers/containers.conf.d", "/etc/containers/containers.conf.d",
           "/usr/share/containers/storage.conf", "/etc/containers/storage.conf")
CONFIG_ENV = ("CONTAINERS_CONF", "CONTAINERS_CONF_OVERRIDE", "CONTAINERS_STORAGE_CONF")


def _facts_key() -> str:
    """Podman's binary and version, and the state of every file that sets its
    runtime or storage; "" where Podman does not say its version."""
    try:
        binary = podman_binary()
    except GpusnapError:
        return ""
    client = version()  # `podman version`: no container's lock taken
    if not client:
        return ""
    seen = [f"{name}={os.environ.get(name, '')}" for name in CONFIG_ENV]
    for where in (binary, *CONFIGS, *filter(None, map(os.environ.get, CONFIG_ENV))):
        found = [where] + (sorted(str(p) for p in Path(where).glob("*.conf"))
                           if os.path.isdir(where) else [])
        for path in found:
            try:
                st = os.stat(path)
                seen.append(f"{path} {st.st_mtime_ns} {st.st_size} {st.st_ino}")
            except OSError:
                seen.append(f"{path} -")
    return hashlib.sha256("\n".join([client, *seen]).encode()).hexdigest()


def _facts_file() -> Path:
    return journal.state_dir() / "podman-facts.json"


def _kept_facts(key: str) -> HostFacts | None:
    try:
        kept = json.loads(_facts_file().read_text())
        if kept.get("key") != key:
            return None
        return HostFacts(kept["version"], kept["runtime"], Path(kept["graph_root"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep_facts(key: str, facts: HostFacts) -> None:
    try:
        write_private(_facts_file(), json.dumps({
            "key": key, "version": facts.version, "runtime": facts.runtime,
            "graph_root": str(facts.graph_root)}))
    except OSError:  # a state folder this user cannot write: asked again next time
        pass


def in_background(ask: Callable[..., T], *args) -> Callable[[], T]:
    """``ask(*args)`` started in a thread; the callable returned waits for it
    (and raises what it raised). A daemon thread: a restore refused before it
    needs the answer exits without waiting for Podman."""
    box: list = []

    def run() -> None:
        try:
            box.append(ask(*args))
        except BaseException as exc:  # handed to the caller, in its thread
            box.append(exc)

    thread = threading.Thread(target=run, name=f"gpusnap-{ask.__name__}", daemon=True)
    thread.start()

    def answer() -> T:
        thread.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]
    return answer


def ask_host_facts() -> Callable[[], HostFacts]:
    """host_facts() in the background: `podman info` is slow (it queries the
    package manager), and a restore asks it before it opens the registry."""
    return in_background(host_facts)


def exists(name: str) -> bool:
    return _run(["container", "exists", name]).returncode == 0


def checkpoint(name: str, export: Path | None, leave_running: bool, tcp_established: bool,
               keep: bool = False, compress: str | None = None,
               watch: Callable[[], None] | None = None) -> None:
    args = ["container", "checkpoint"]
    if export is not None:
        args += ["--export", str(export)]
    if compress is not None:
        args += ["--compress", compress]
    if leave_running:
        args.append("--leave-running")
    if tcp_established:
        args.append("--tcp-established")
    if keep:
        args.append("--keep")
    res = _run(args + [name], Bound.of("PODMAN_CHECKPOINT"), watch)
    if res.returncode != 0:
        raise GpusnapError(f"podman container checkpoint {name}: {_last_error(res.stderr)}",
                           _checkpoint_hint(res.stderr))


def _checkpoint_hint(stderr: str) -> str:
    if "no space left" in stderr.lower():
        return "free disk space where the checkpoint is written, then try again"
    if "criu" in stderr.lower():
        return "see dump.log in the container's userdata directory; `gpusnap doctor` checks CRIU"
    return "`gpusnap doctor` checks the host"


def restore(source: str, *, archive: bool, name: str | None, keep: bool,
            tcp_established: bool, size: int = 0,
            watch: Callable[[], None] | None = None,
            progress: Callable[[], int] | None = None) -> str:
    """Restore a checkpointed container or an exported archive; returns the container id.

    Bounded by the bytes it restores (``size``), the bound restarting while
    ``progress`` moves; ``watch`` is called while it runs and may raise (the
    stream Podman reads has died): Podman is stopped."""
    args = ["container", "restore"]
    if archive:
        args += ["--import", source]
        if name:
            args += ["--name", name]
    if keep:
        args.append("--keep")
    if tcp_established:
        args.append("--tcp-established")
    if not archive:
        args.append(source)
    res = _run(args, Bound.for_bytes("PODMAN_RESTORE", size), watch, progress)
    if res.returncode != 0:
        err = _last_error(res.stderr)
        hint = "`gpusnap inspect` shows what the checkpoint needs"
        if "already in use" in err or "already exists" in err:
            hint = "remove the existing container or restore under another --name"
        elif "requested static ip" in err or "requested static mac" in err:
            # Another host's network (a Podman 4 host's 10.88/16 against a Podman 5 host's, say)
            hint = ("the checkpoint keeps the address it had on its network, which this host's "
                    "network does not hold: restore it under a new --name (Podman then gives it "
                    "an address here)")
        raise GpusnapError(f"podman container restore: {err}", hint)
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""


def remove(name: str, force: bool = False) -> None:
    """Remove a container that is not running; ``force``: a running one too, at
    once (only one gpusnap itself just restored and cannot let run on)."""
    res = _run(["rm", *(["-f", "-t", "0"] if force else []), name])
    if res.returncode != 0 and "no such container" not in res.stderr.lower():
        raise GpusnapError(f"podman rm {name}: {_last_error(res.stderr)}")


def drop_checkpoint(ctr: Container) -> None:
    """Remove the files of a restored container's local checkpoint that Podman's
    restore without --keep removes (its database still names the checkpoint
    path): for a restore that asked Podman to keep them until it knew the
    restore held (the GPU state back on the GPU)."""
    for name in CHECKPOINT_DIRS:
        shutil.rmtree(ctr.userdata / name, ignore_errors=True)
    for name in CHECKPOINT_FILES:
        with contextlib.suppress(FileNotFoundError):
            (ctr.userdata / name).unlink()

