"""Restore a Podman container from an export archive or a local checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

from gpusnap import archive, journal
from gpusnap.criu.version import require_supported
from gpusnap.errors import GpusnapError
from gpusnap.gpu.compat import restore_problems
from gpusnap.gpu.cuda import ProcessState
from gpusnap.gpu.inventory import read_inventory
from gpusnap.ops.gpu_state import load_driver
from gpusnap.ops.preconditions import has_checkpoint
from gpusnap.procs import cuda_processes
from gpusnap.runtime import podman
from gpusnap.runtime.stream import import_fifo


def _checks(contents: archive.CheckpointContents) -> None:
    require_supported("restore")
    problems = restore_problems(contents.manifest, read_inventory())
    if problems:
        raise GpusnapError("cannot restore here: " + "; ".join(problems),
                           "restore on a host with the checkpoint's GPUs (`gpusnap inspect` "
                           "lists them); nothing was changed")


def run(source: str, name: str | None, keep: bool, tcp_established: bool) -> dict:
    path = Path(source)
    if path.exists():
        contents = archive.read(str(path), head_only=True)
        config = contents.json_file("config.dump") or {}
        target = name or config.get("name")
        if target and podman.exists(target):
            raise GpusnapError(f"a container named {target} already exists",
                               f"remove it (`podman rm {target}`) or restore with --name NEW")
        _checks(contents)
        archive_mode = True
    elif podman.exists(source):
        ctr = podman.inspect(source)
        if ctr.running:
            raise GpusnapError(f"container {ctr.name} is running; there is nothing to restore")
        if not has_checkpoint(ctr):
            raise GpusnapError(f"container {ctr.name} has no checkpoint to restore",
                               "checkpoint it first with `gpusnap checkpoint`")
        if name:
            raise GpusnapError("--name applies only when restoring from an archive")
        contents = archive.read_directory(ctr.userdata)
        _checks(contents)
        archive_mode = False
    elif "/" in source or source.endswith((".tar", ".zst", ".gz")):
        raise GpusnapError(f"no such file: {source}", "check the path of the exported archive")
    else:
        raise GpusnapError(f"{source} is neither a checkpoint archive nor a container",
                           "pass a file from `gpusnap checkpoint --export` or a checkpointed "
                           "container's name (`podman ps -a`)")
    start = time.monotonic()
    if archive_mode:
        try:
            with import_fifo(path.absolute()) as src:
                podman.restore(str(src), archive=True, name=name, keep=keep,
                               tcp_established=tcp_established)
        except GpusnapError as exc:
            _drop_half_restored(target)
            raise GpusnapError(f"{exc.message}; nothing was restored, {source} is unchanged",
                               exc.hint) from None
    else:
        podman.restore(source, archive=False, name=name, keep=keep,
                       tcp_established=tcp_established)
    seconds = time.monotonic() - start
    target = name or (contents.json_file("config.dump") or {}).get("name") or source
    ctr = podman.inspect(target)
    gpu = _gpu_report(ctr.pid)
    journal.record("restored", container=ctr.id, source=source, seconds=round(seconds, 3))
    return {"container": {"id": ctr.id, "name": ctr.name, "status": ctr.status},
            "source": source, "seconds": round(seconds, 3), "gpu_processes": gpu}


def _drop_half_restored(name: str | None) -> None:
    """An import that failed (a damaged archive) may leave a created container
    behind; the name was free before, so it is ours to remove."""
    if name and podman.exists(name) and not podman.inspect(name).running:
        podman.remove(name)


def _gpu_report(pid: int) -> list[dict]:
    procs = cuda_processes(pid)
    if not procs:
        return []
    driver = load_driver()
    report = []
    for p in procs:
        state, why = None, "no CUDA driver"
        if driver is not None:
            try:
                state = driver.state(p.pid)
            except Exception as exc:  # noqa: BLE001 -- reported, not fatal: it was restored
                why = str(exc)
        entry = {"pid": p.pid, "comm": p.comm, "state": state.name if state is not None else "unknown"}
        if state is None:
            entry["error"] = why
        report.append(entry)
        if state is not None and state != ProcessState.RUNNING:
            raise GpusnapError(f"restored, but process {p.pid} ({p.comm}) is {state.name} on the GPU",
                               "`gpusnap thaw` the container, or `gpusnap doctor --fix`")
    return report
