"""`gpusnap restore REF`: the checks a restore makes, before gigabytes are
downloaded; then the checkpoint streamed into Podman's import (the files
that name devices fetched first and edited once where GPUs move), or staged
on disk where it must be; the pages written where CRIU reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Callable

from gpusnap import archive as archive_files
from gpusnap import journal, procs
from gpusnap.pages import pages_aside
from gpusnap.criu.runtimes import require_gpu_restore, runs_action_script
from gpusnap.criu.version import require_supported
from gpusnap.errors import GpusnapError
from gpusnap.gpu.checks import HostFacts, read_host_facts
from gpusnap.gpu.inventory import Inventory, read_inventory
from gpusnap.gpu.manifest import Manifest
from gpusnap.oci import bundle as fmt
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.registry import RegistryOptions
from gpusnap.oci.tarfiles import PipeWriter, ReaderStopped
from gpusnap.ops import gpu_plan
from gpusnap.ops import restore as ops_restore
from gpusnap.ops import restore_check
from gpusnap.ops.engines import refuse_engine
from gpusnap.ops.pull import (PULL_MISSING, OnTrusted, Remote, fetch_small, open_remote,
                              write_archive, write_files)
from gpusnap.pages import fill_plan, prepared_pages
from gpusnap.pages import memory
from gpusnap.pages.memory import pages_dir
from gpusnap.runtime import podman, retarget, step_agent
from gpusnap.runtime import stream as stream_module
from gpusnap.runtime.storage import PULL_PREFIX, discard, fifo_dir, staging_dir
from gpusnap.trust.options import TrustOptions


def _restore_checks(remote: Remote, name: str | None, gpu_map: str | None,
                    facts: Callable[[], podman.HostFacts],
                    name_taken: Callable[[], bool] | None = None,
                    inventory: Callable[[], Inventory] | None = None,
                    host: Callable[[], HostFacts] | None = None):
    """What restore would refuse, refused before gigabytes are downloaded; the GPU
    plan. ``name_taken`` answers whether --name's container exists, ``inventory``
    NVML's GPUs, ``host`` the CRIU and kernel checks' facts (each asked while
    the registry was)."""
    if remote.bundle.summary.get("engine", "podman") != "podman":  # containerd's: --to containerd://
        refuse_engine(remote.bundle.summary, str(remote.client.ref), "podman")
    if fmt.is_pre_checkpoint(remote.manifest) and not name:
        raise GpusnapError(f"{remote.client.ref} is a pre-checkpoint: its container kept running "
                           "on the source, so it would resume from an older state",
                           "restore the final round `gpusnap migrate` pushes, or pass --name NEW "
                           "to start a copy of this one; nothing was downloaded")
    target = name or (remote.bundle.summary.get("container") or {}).get("name")
    taken = name_taken or (lambda: podman.exists(target))  # name_taken: asked for --name
    if target and taken():  # --dry-run too: a check the restore makes
        raise ops_restore.name_taken(target)
    manifest = remote.bundle.gpu_manifest
    require_gpu_restore(remote.bundle.summary.get("runtime") or facts().runtime, manifest,
                        str(remote.client.ref), "nothing was downloaded")
    return gpu_plan.plan_here(Manifest.from_dict(manifest) if manifest else None, gpu_map,
                              inventory=inventory() if inventory else None,
                              host=host() if host else None,
                              refusal_hint="restore on a host with GPUs like the checkpoint's "
                                           "(`gpusnap inspect REF` lists them), or name targets "
                                           "with --gpu-map; nothing was downloaded")


def _staged_pull(remote: Remote, archive: Path, work: Path, **kw) -> dict:
    try:
        return write_archive(remote, archive, **kw)
    except GpusnapError as exc:
        if "disk is full" not in exc.message:
            raise
        raise GpusnapError(exc.message.replace(str(archive), str(remote.client.ref)),
                           f"free {remote.bundle.total_bytes >> 20} MiB in {work.parent} "
                           "(restore stages the pull beside Podman's storage or in "
                           "/var/tmp, whichever has more room); nothing was restored") \
            from None


def _head_files(remote: Remote, plan, use_cache: bool = True, cache_root: Path | None = None,
                **_) -> dict[str, bytes] | None:
    """config.dump and spec.dump, fetched ahead of the rest: what Podman reads on
    the opens before the one that imports (None: the bundle lacks one); where the
    plan changes device nodes (moved GPUs, renumbered ones), every other file
    that names devices too (retarget.names_devices), edited before the stream starts."""
    entries = [f for f in remote.bundle.files if f.type == "file" and (
        f.path in stream_module.CONFIG_FILES
        or (not plan.remap.empty and retarget.names_devices(f.path)))]
    if sum(f.path in stream_module.CONFIG_FILES for f in entries) != \
            len(stream_module.CONFIG_FILES):
        return None
    return fetch_small(remote, entries, ChunkCache.open(cache_root) if use_cache else None)


def _json_or_none(data: bytes) -> dict | None:
    try:
        parsed = json.loads(data)
    except ValueError:  # said where Podman reads it
        return None
    return parsed if isinstance(parsed, dict) else None


def _restore_streaming(remote: Remote, files: dict[str, bytes], opens: int, plan,
                       name: str | None, keep: bool, tcp_established: bool,
                       facts: podman.HostFacts, **kw) -> tuple[dict, dict]:
    """Podman imports through a FIFO fed by the download as it arrives: the
    restore overlaps the download, and nothing is staged on disk. Podman's
    first ``opens`` opens get a tar of ``files`` (config.dump, spec.dump)."""
    contents = archive_files.CheckpointContents(source=str(remote.client.ref), files=dict(files))
    target = name or (remote.bundle.summary.get("container") or {}).get("name")
    label = str(remote.client.ref)
    cancel = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="gpusnap-download")
    job = None
    # CRIU's memory pages go to a folder of their own, not through Podman's
    # import (one thread, the slowest copy of a restore): Podman gets symlinks,
    # the pre-restore action renames them into place or links them (pages/pages_aside.py).
    scripted = runs_action_script(_restoring_runtime(files, facts.runtime))
    # not for --keep: on another filesystem Podman's kept checkpoint would hold
    # links into a folder that is gone once the restore is done
    aside = pages_aside.enabled() and scripted and not keep
    where = prepared_pages.roots(facts.graph_root) if aside else []
    prepared = prepared_pages.best(remote.bundle, where) if aside else None
    if prepared is not None and not prepared_pages.claim(prepared):
        prepared = None  # another restore took it: written anew
        journal.record("prepared-lost", ref=str(remote.client.ref))
    pages, agent, kept, restored = None, None, None, False
    try:  # from the claim on, every way out releases it (finally)
        if prepared is not None and not prepared.exact:
            cache = ChunkCache.open(kw.get("cache_root")) if kw.get("use_cache", True) else None
            prepared_pages.parent_plans(prepared, remote.bundle,
                                        fetch_small(remote, prepared_pages.pagemaps(remote.bundle),
                                                    cache))
        pages = _pages_folder(remote, prepared) if aside else None
        agent = _early_agent(remote) if scripted else None
        if agent is not None:  # the images name it: CRIU's pre-restore asks it
            kw["edits"] = {**kw.get("edits", {}), **agent.member()}
        # Leaving this stops the pump: a download blocked on the full pipe fails then.
        # The FIFO's folder is where doctor looks for what a killed CLI left.
        with tempfile.TemporaryDirectory(prefix=PULL_PREFIX, dir=fifo_dir()) as near, \
                stream_module.import_piped(Path(near), stream_module.config_tar(files), opens,
                                           target) as (stream, sink):
            job = pool.submit(write_files, remote, PipeWriter(sink, pages), Path(label),
                              cancel=cancel, prepared=prepared, **kw)
            result = ops_restore.import_archive(nullcontext(stream), contents, plan, name, keep,
                                                tcp_established, label,
                                                size=remote.bundle.total_bytes)
            restored = True
    except BaseException as exc:
        cancel.set()
        if job is None:
            raise
        futures_wait([job])
        raise _why_it_failed(job.exception(), exc) from None
    finally:
        if agent is not None:
            agent.done()
        pool.shutdown(wait=True)
        # why nothing prepared was taken: asked before this restore's own pages lie beside
        why = _unprepared(remote, where, prepared, aside) if restored else None
        if restored and pages is not None and prepared is None and job.exception() is None:
            kept = _keep_pages(remote, pages, result)  # written anew: the next replica links them
        if pages is not None and kept is None and not _held_by_a_kept_checkpoint(pages, restored):
            discard(pages, pages.parent)  # restored (or not needed): in the background
        if prepared is None or not _held_by_a_kept_checkpoint(prepared.claimed, restored):
            prepared_pages.release(prepared, untouched=job is None)  # spent, unless a kept checkpoint's parent
        memory.let_go()  # restored or not: what it took is in MemAvailable now
    ref = remote.client.ref
    prepared_pages.drop_rounds(f"{ref.registry}/{ref.repository}", where)
    return result, {**job.result(), "streamed": True, "pages_prepared_skipped": why,
                    "pages_kept": kept}


def _why_it_failed(cause: BaseException | None, seen: BaseException) -> BaseException:
    """What a streamed restore that failed says: the download's failure where it
    had one (Podman then failed on the stream it cut), else what was ``seen``."""
    if isinstance(cause, GpusnapError) and not isinstance(cause, ReaderStopped):
        return cause
    if isinstance(cause, OSError) and not isinstance(cause, BrokenPipeError):
        return cause  # a full disk writing the pages: said, not Podman's "killed"
    return seen


def _held_by_a_kept_checkpoint(pages: Path | None, restored: bool) -> bool:
    """Whether the checkpoint a failed restore's last step kept (for `gpusnap
    restore NAME`: runtime/kept_checkpoint.py) links into ``pages`` (its pages,
    or round 1's folder as its parent): then they stay."""
    if restored or pages is None:
        return False
    from gpusnap.ops.leftovers import linked_from_checkpoints  # a failed restore only

    linked = linked_from_checkpoints()
    if pages not in linked and Path(os.path.realpath(pages)) not in linked:
        return False
    journal.record("pages-kept", folder=str(pages), why="a kept checkpoint links into them")
    return True


def _early_agent(remote: Remote) -> step_agent.EarlyAgent | None:
    """CRIU's step agent (the runtime runs gpusnap's action script), started now
    where pre-restore would start one (a GPU checkpoint, or memory big enough for
    a fill): its Python, libcuda and NVML load while Podman imports, not in
    CRIU's stop (runtime/step_agent.py)."""
    gpu = bool(remote.bundle.gpu_manifest)
    if not (gpu or remote.bundle.total_bytes >= fill_plan.MIN_TOTAL):
        return None
    try:
        if not fill_plan.settings().agent:
            return None  # page-fill.json: each step in a Python of its own
    except ValueError:
        return None  # CRIU's steps say what is wrong with it
    return step_agent.start(driver=gpu)


def _unprepared(remote: Remote, where: list[Path], prepared: prepared_pages.Match | None,
                aside: bool) -> str | None:
    """Why a restore took nothing from a prepared folder (--json); None where it did."""
    if not aside:
        return ("pages go through Podman's import (GPUSNAP_PAGES_ASIDE=0, or a runtime "
                "without the action script)")
    return prepared_pages.explain(remote.bundle, where, prepared)


def _keep_pages(remote: Remote, pages: Path, result: dict) -> dict | None:
    """The pages a restore wrote anew, kept for the next replica where RAM allows
    (prepared_pages.keep); None where not (the caller discards them)."""
    if fmt.is_pre_checkpoint(remote.manifest):
        return None  # its final round comes next, and drops its round's folders (drop_rounds)
    if _maybe_still_mapped(result["container"]["pid"]):
        return None  # a kept file may be patched later: none may show through a mapping
    ref = remote.client.ref
    with suppress(OSError):
        return prepared_pages.keep(remote.bundle, remote.digest, pages,
                                   repository=f"{ref.registry}/{ref.repository}")
    return None


def _maybe_still_mapped(init_pid: int) -> bool:
    """Whether a restored process may still map a page of this restore's pages
    files (restore_check.staging_in_doubt; the opt-in staging mapping only)."""
    try:
        if not fill_plan.settings().map_staging:
            return False
    except ValueError:
        return True  # an unreadable page-fill.json (the restore's steps said so): keep nothing
    return restore_check.staging_in_doubt(init_pid)


def _pages_folder(remote: Remote, prepared: prepared_pages.Match | None) -> Path:
    """Where a restore writes CRIU's pages: beside the prepared files it links or
    moves (the same filesystem), else RAM (prepared files of other checkpoints
    give way there: prepared_pages.evict_for), else pages_dir's disk."""
    root = prepared.root if prepared is not None else \
        pages_dir(remote.bundle.total_bytes, prepared_pages.evict_for)
    folder = Path(tempfile.mkdtemp(prefix=PULL_PREFIX, dir=root))
    if prepared is None:
        memory.hold_folder(folder)  # RAM held for it narrows as its pages come in
    elif memory.in_ram(root):  # no check chose it: the process CRIU restores is held, whole,
        total = remote.bundle.total_bytes  # and a patched folder's pages not prepared, written anew
        memory.hold_only(total + (0 if prepared.exact else max(0, total - prepared.same_bytes)))
    return folder


def _restoring_runtime(files: dict[str, bytes], default: str) -> str:
    """The OCI runtime Podman restores with: the one config.dump names (Podman
    keeps the checkpointed container's), else Podman's ``default``."""
    try:
        named = json.loads(files.get("config.dump") or b"{}").get("runtime")
    except (ValueError, AttributeError):
        named = None
    return named or default


def _restore_staged(remote: Remote, plan, name: str | None, keep: bool, tcp_established: bool,
                    **kw) -> tuple[dict, dict]:
    """Pull into a staged plain tar, then import it under ``plan`` (made before
    the download, not again) as `gpusnap restore FILE` does."""
    work = Path(tempfile.mkdtemp(prefix=PULL_PREFIX,
                                 dir=staging_dir(remote.bundle.total_bytes + (64 << 20))))
    archive = work / "checkpoint.tar"
    label = str(remote.client.ref)
    try:
        pulled = _staged_pull(remote, archive, work, **kw)
        contents = archive_files.read(str(archive), head_only=True)
        return ops_restore.import_file(archive, contents, plan, name, keep, tcp_established,
                                       label), pulled
    except GpusnapError as exc:
        raise GpusnapError(exc.message.replace(str(archive), label), exc.hint) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def restore(ref_text: str, name: str | None, keep: bool, tcp_established: bool,
            opts: RegistryOptions, gpu_map: str | None = None, dry_run: bool = False,
            trust: TrustOptions | None = None, on_trusted: OnTrusted | None = None,
            pull: str = PULL_MISSING, facts: Callable[[], podman.HostFacts] | None = None,
            name_taken: Callable[[], bool] | None = None, **kw) -> dict:
    """Podman imports the plain tar as the chunks arrive (no compression round
    trip, nothing staged; moved GPUs' files edited on the way); where Podman is
    not known to read only the config first, a staged pull, then restore.
    ``pull``: PULL_MISSING or PULL_ALWAYS (open_remote). ``facts`` and
    ``name_taken``: Podman's answers, asked in the background by the caller
    (else here, while the registry is asked)."""

    facts = facts or podman.ask_host_facts()
    if name_taken is None and name:
        name_taken = podman.in_background(podman.exists, name)
    # NVML's first read takes a GPU host tens of milliseconds, `criu --version`
    # (CRIU's own glibc, from a cold page cache) as long: both beside the registry's
    inventory = podman.in_background(read_inventory)
    host = podman.in_background(read_host_facts)
    start = time.monotonic()
    try:
        cache = ChunkCache.open(kw.get("cache_root")) if kw.get("use_cache", True) else None
        remote = open_remote(ref_text, opts, trust, cache, pull)
        opened = time.monotonic()
        plan = _restore_checks(remote, name, gpu_map, facts, name_taken, inventory, host)
    except BaseException:
        # refused before the plan: NVML's read and `criu --version` (each bounded)
        # end before this process does, never cut off mid-call by its exit
        for asked in (inventory, host):
            with suppress(BaseException):
                asked()
        raise
    if dry_run:
        return ops_restore.plan_report(str(remote.client.ref), plan)
    require_supported("restore", host().criu_version)
    # what a restore spends before Podman starts, in its timeline (bench/coldstart.py);
    # ``before``: this process's start-up and options until the registry was asked
    age = procs.age_s(os.getpid())
    journal.record("restore-checked", timing={
        "before": round(age - (time.monotonic() - start), 3) if age is not None else None,
        "registry": round(opened - start, 3), "checks": round(time.monotonic() - opened, 3)})
    if on_trusted:
        on_trusted(remote.trust)
    # Podman 4.3 reads the config alone on its first opens; with another Podman
    # (or a bundle without a config), a staged pull, then a restore of the file.
    opens = stream_module.config_only_opens(facts().version or podman.version())
    head = _head_files(remote, plan, **kw) if opens else None
    if head is not None:  # Podman imports while the chunks arrive
        renumbered = gpu_plan.with_host_numbers(plan, _json_or_none(head["spec.dump"]))
        if renumbered is not plan and plan.remap.empty:  # /dev/nvidia-uvm: /dev's image too
            head = _head_files(remote, renumbered, **kw) or head
        plan = renumbered
        # Moved GPUs: the files that name devices, edited once here (a spec that
        # cannot move is refused before Podman starts) and written in the stream;
        # with any GPU, the plan beside them (gpu_plan.carried says why).
        edits = retarget.edit_members(head, plan.remap, plan.to_dict()) \
            if gpu_plan.carried(plan) else {}
        files = {n: edits.get(n, head[n]) for n in stream_module.CONFIG_FILES}
        result, pulled = _restore_streaming(remote, files, opens, plan, name, keep,
                                            tcp_established, facts(), edits=edits, **kw)
    else:
        result, pulled = _restore_staged(remote, plan, name, keep, tcp_established, **kw)
    result["source"] = str(remote.client.ref)
    result["pull"] = {**pulled, "registry_asked": remote.asked}
    result["trust"] = remote.trust
    return result
