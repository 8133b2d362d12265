"""containerd checkpoints through a registry: `gpusnap push containerd://[NS/]NAME REF` and
`gpusnap restore REF --to containerd://NS[/ID]`.

Push: NAME is looked up in namespace NS as a container, then as an image. A
container is checkpointed into a checkpoint image as `ctr c checkpoint --task
--rw` makes one (the task paused, then stopped unless --leave-running); that
image, or one the user made, is laid out as a directory
(gpusnap.ops.containerd_checkpoint.export_image) and pushed by the chunked
path like a Podman checkpoint directory. The image made here is deleted once
the push succeeded: until then the stopped container is restorable from it.

The bundle's summary says `engine: containerd` with the image, runtime and
snapshotter (gpusnap.archive), so `inspect` shows it and a restore refuses the
wrong engine before anything is downloaded.

Restore: checks (the engine, the image in the target namespace, the container
id free, the GPU plan), then the chunks are written into a staged directory,
import_dir makes the container and restores its task (the shim applies the GPU
plan at Start), and the staging goes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from gpusnap import archive, journal
from gpusnap.errors import GpusnapError
from gpusnap.gpu.gpumap import GPU_MAP_ANNOTATION
from gpusnap.gpu.manifest import Manifest
from gpusnap.oci.cache import ChunkCache
from gpusnap.oci.dirfiles import DirectoryWriter
from gpusnap.ops import restore as ops_restore
from gpusnap.ops import restore_check
from gpusnap.ops.containerd_api import Client, ContainerdError
from gpusnap.ops.containerd_checkpoint import checkpoint_container, export_image, import_dir
from gpusnap.ops.engines import ENGINE, refuse_engine
from gpusnap.ops import gpu_plan as gpu_planning
from gpusnap.ops.push_source import (PushSource, dir_size, kept_error, mark_only_copy,
                                     push_again_words)
from gpusnap.runtime.storage import PULL_PREFIX, PUSH_PREFIX, roomiest

if TYPE_CHECKING:
    from gpusnap.oci.registry import RegistryOptions
    from gpusnap.oci.transfer import Progress
    from gpusnap.ops.pull import Remote
    from gpusnap.trust.options import TrustOptions

SCHEME = "containerd://"
DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
ADDRESS_ENV = "CONTAINERD_ADDRESS"  # as ctr reads them
NAMESPACE_ENV = "CONTAINERD_NAMESPACE"
CHECKPOINT_IMAGE_PREFIX = "localhost/gpusnap-checkpoint/"
# containerd's namespace rule (identifiers.Validate)
_NAMESPACE = re.compile(r"^[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*$")


@dataclass(frozen=True)
class Location:
    """A namespace of one containerd, and a container or image name in it ("" when none was given)."""

    namespace: str
    name: str


def is_uri(text: str) -> bool:
    return text.startswith(SCHEME)


def parse_uri(text: str) -> Location:
    """containerd://[NAMESPACE/]NAME: with a slash the first segment is the namespace
    (so an image such as localhost/app:ckpt is containerd://NS/localhost/app:ckpt);
    without one, NAME in $CONTAINERD_NAMESPACE or "default", as ctr."""
    rest = text[len(SCHEME):] if is_uri(text) else text
    namespace, slash, name = rest.partition("/")
    if not slash:
        namespace, name = os.environ.get(NAMESPACE_ENV) or "default", rest
    if not _NAMESPACE.match(namespace):
        raise GpusnapError(f"{text}: {namespace!r} is not a containerd namespace",
                           "write containerd://[NAMESPACE/]NAME (letters, digits, '.', '_', '-')")
    return Location(namespace, name)


def staging_dir(size: int) -> Path:
    """Where a checkpoint directory is staged: /var/tmp (never /tmp, often a small tmpfs).
    Not beside Podman's storage as for Podman checkpoints: a containerd host may have no
    Podman, and `podman info` waits on other Podman commands' locks."""
    root = Path(os.environ.get("GPUSNAP_STAGING_DIR") or "/var/tmp")
    if not root.is_dir():
        raise GpusnapError(f"{root} is not a directory: there is nowhere to stage the checkpoint",
                           "create it, or set GPUSNAP_STAGING_DIR to a directory with room")
    return roomiest([root], size, "free space there (or set GPUSNAP_STAGING_DIR to a larger disk)")


def _address(address: str | None) -> str:
    return address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def _ctr(address: str, namespace: str) -> str:
    """The ctr command line a hint names, with --address when it is not the default."""
    flag = f" --address {address}" if address != DEFAULT_ADDRESS else ""
    return f"ctr{flag} -n {namespace}"


@contextmanager
def _client(address: str, namespace: str) -> Iterator["Client"]:
    """A containerd client; its failures become one line."""
    if not Path(address).exists():
        raise GpusnapError(f"no containerd socket at {address}",
                           "start containerd, or pass --containerd-address PATH (or set "
                           f"${ADDRESS_ENV})")
    try:
        with Client(address, namespace) as c:
            yield c
    except ContainerdError as exc:
        raise GpusnapError(f"containerd at {address}: {exc}",
                           "check containerd's log; nothing else was changed") from None


def _exists(c: "Client", kind: str, name: str) -> bool:
    try:
        if kind == "container":
            c.call("containers", "Containers", "Get", id=name)
        else:
            c.call("images", "Images", "Get", name=name)
        return True
    except ContainerdError as exc:
        if "not found" in str(exc):
            return False
        raise


def _status(c: "Client", container: str) -> int | None:
    try:
        return c.call("tasks", "Tasks", "Get", container_id=container).process.status
    except ContainerdError:
        return None


def _running(c: "Client", container: str) -> bool:
    return _status(c, container) == c.pb.task_types.RUNNING


def _alive(c: "Client", container: str) -> bool:
    """Running, or paused: a checkpoint whose client Resume failed leaves it paused,
    and gpusnap's guardian resumes it once the command has ended."""
    return _status(c, container) in (c.pb.task_types.RUNNING, c.pb.task_types.PAUSED,
                                     c.pb.task_types.PAUSING)


# --- push --------------------------------------------------------------------------------


def _container_of(spec: dict) -> str:
    """The container id a checkpoint image does not record: ctr and nerdctl put it last in the cgroup path."""
    cgroup = (spec.get("linux") or {}).get("cgroupsPath") or ""
    return re.split(r"[/:]", cgroup)[-1] if cgroup else ""


def _record_origin(dest: Path, namespace: str, container: str | None) -> dict:
    """containerd.json completed with where the checkpoint comes from (inspect shows it)."""
    meta_file = dest / "containerd.json"
    meta = json.loads(meta_file.read_text())
    spec = json.loads((dest / "spec.json").read_text())
    meta["namespace"] = namespace
    meta["container"] = container or _container_of(spec)
    meta_file.write_text(json.dumps(meta, indent=1))
    return meta


@contextmanager
def push_source(source: str, leave_running: bool, on_checkpoint: Callable[[str], None] | None,
                address: str | None = None,
                push_again: Callable[[str], str] = push_again_words) -> Iterator["PushSource"]:
    """SOURCE (containerd://[NS/]NAME) as a checkpoint directory for push(): a container
    checkpointed first, or a checkpoint image laid out. ``push_again``: the
    retry of this push, for a path."""
    address = _address(address)
    loc = parse_uri(source)
    if not loc.name:
        raise GpusnapError(f"{source} names no container or image",
                           "pass containerd://[NAMESPACE/]NAME")
    ctr = _ctr(address, loc.namespace)
    work = Path(tempfile.mkdtemp(prefix=PUSH_PREFIX, dir=staging_dir(0)))
    dest = work / "checkpoint"
    image = None  # the checkpoint image made here
    stopped = False  # the task is down: the image and DEST are what is left of it
    try:
        with _client(address, loc.namespace) as c:
            if _exists(c, "container", loc.name):
                if not _running(c, loc.name):
                    raise GpusnapError(f"container {loc.name} in namespace {loc.namespace} has no "
                                       "running task: there is nothing to checkpoint",
                                       f"start its task (`{ctr} tasks ls` shows it), or push "
                                       f"a checkpoint image: {SCHEME}{loc.namespace}/IMAGE")
                if on_checkpoint:
                    on_checkpoint(loc.name)
                image = (f"{CHECKPOINT_IMAGE_PREFIX}{loc.name}:"
                         f"{time.strftime('%Y%m%d%H%M%S')}-{os.urandom(3).hex()}")
                _checkpoint_task(c, ctr, loc, image, leave_running)
                stopped = not leave_running
                what, container = image, loc.name
            elif _exists(c, "image", loc.name):
                what, container = loc.name, None
            else:
                raise GpusnapError(f"{source}: no container or image {loc.name} in namespace "
                                   f"{loc.namespace}",
                                   f"`{ctr} containers ls` and `{ctr} images ls` list them")
            try:
                export_image(c, what, dest)
            except ContainerdError as exc:
                hint = (f"make one with `{ctr} containers checkpoint --task --rw CONTAINER IMAGE`, "
                        "or name a running container") if container is None else \
                    f"free space in {work.parent}"
                raise GpusnapError(f"{what}: {exc}", hint) from None
            except OSError as exc:  # said with what is kept (below), as any failure once stopped
                raise GpusnapError(f"{what}: cannot write {exc.filename or dest}: {exc.strerror}",
                                   f"free space in {work.parent}") from None
            _record_origin(dest, loc.namespace, container)
            if stopped:  # the image, and DEST now whole: `doctor --fix` keeps DEST
                mark_only_copy(work, loc.name, dest, f"`{push_again(str(dest))}`",
                               _restore_words(ctr, loc.name, image))
        size = dir_size(dest)
        yield PushSource("containerd-container" if container else "containerd-image", dest, size,
                         size, container=container)
    except (GpusnapError, KeyboardInterrupt) as exc:
        if image and not stopped:  # failed or interrupted once CRIU was done: is it stopped?
            stopped = _only_copy(address, loc.namespace, loc.name, image, leave_running)
        if not stopped:
            raise

        kept = f" and in {dest}" if dest.is_dir() else ""
        again = str(dest) if dest.is_dir() else f"{SCHEME}{loc.namespace}/{image}"
        raise kept_error(exc, f"{loc.name} in namespace {loc.namespace}",
                         f"as image {image}{kept}", again,
                         _restore_words(ctr, loc.name, image)) from None
    else:
        shutil.rmtree(work, ignore_errors=True)
        if image:  # pushed: the registry holds the checkpoint now
            _delete_image(address, loc.namespace, image)
            image = None
    finally:
        if not stopped:
            shutil.rmtree(work, ignore_errors=True)
            if image:
                _delete_image(address, loc.namespace, image)


def _checkpoint_task(c, ctr: str, loc, image: str, leave_running: bool) -> None:
    try:
        checkpoint_container(c, loc.name, image, exit_after=not leave_running)
    except ContainerdError as exc:
        state = "it was left running" if (_alive if leave_running else _running)(
            c, loc.name) else f"its task stopped (`{ctr} tasks ls` shows it)"
        raise GpusnapError(f"checkpointing {loc.name} in namespace {loc.namespace} failed: {exc}",
                           f"{state}; the shim's log (containerd's journal) says more") from None


def _restore_words(ctr: str, name: str, image: str) -> str:
    return (f"`{ctr} tasks rm {name}; {ctr} containers rm {name}; "
            f"{ctr} containers restore --rw --live {name} {image}`")


def _only_copy(address: str, namespace: str, container: str, image: str,
               leave_running: bool = True) -> bool:
    """The checkpoint image was made and the container's task is no longer running.
    A leave-running push's paused task is alive (its guardian resumes it); a
    --stop push's paused one may hold a SIGKILL its thaw delivers: not alive."""
    up = _alive if leave_running else _running
    try:
        with _client(address, namespace) as c:
            return _exists(c, "image", image) and not up(c, container)
    except GpusnapError:
        return True  # cannot tell: keep it rather than lose it


def _delete_image(address: str, namespace: str, image: str) -> None:
    try:
        with Client(address, namespace) as c:
            c.call("images", "Images", "Delete", name=image, sync=True)
    except ContainerdError:
        pass  # a leftover image is harmless: `ctr images rm` removes it


# --- restore -----------------------------------------------------------------------------


def target_location(to: str, name: str | None) -> Location:
    """--to containerd://NAMESPACE[/ID] with -n/--name: the namespace (always the first segment
    here: a target names one; empty: $CONTAINERD_NAMESPACE or "default") and the container id
    ("": the checkpoint's)."""
    if not is_uri(to):
        raise GpusnapError(f"--to {to}: not a containerd target", "write --to containerd://NAMESPACE/ID")
    namespace, _, container = to[len(SCHEME):].partition("/")
    namespace = namespace or os.environ.get(NAMESPACE_ENV) or "default"
    if not _NAMESPACE.match(namespace) or "/" in container:
        raise GpusnapError(f"--to {to}: not containerd://NAMESPACE[/ID]",
                           "e.g. --to containerd://default/trainer")
    if name and container and name != container:
        raise GpusnapError(f"--to names container {container}, --name {name}", "give one of them")
    return Location(namespace, container or name or "")


@dataclass(frozen=True)
class RestorePlan:
    """What the checks decided: where the container goes, and what it needs there."""

    address: str
    namespace: str
    container: str
    image: str
    runtime: str
    gpu_plan: object  # gpusnap.gpu.plan.Plan
    gpu_map: str | None


def plan_restore(summary: dict, gpu_manifest: "Manifest | None", where: str, to: str,
                 name: str | None, address: str | None, gpu_map: str | None) -> RestorePlan:
    """Everything a containerd restore would refuse, refused before anything is downloaded or made."""
    refuse_engine(summary, where, ENGINE, to)
    loc = target_location(to, name)
    meta = summary.get(ENGINE) or {}
    container = loc.name or (summary.get("container") or {}).get("name") or ""
    if not container:
        raise GpusnapError(f"{where} does not say which container it was",
                           "name one: --to containerd://NAMESPACE/ID")
    address = _address(address)
    ctr = _ctr(address, loc.namespace)
    image = meta.get("image") or ""
    with _client(address, loc.namespace) as c:
        if not image or not _exists(c, "image", image):
            raise GpusnapError(f"image {image or '(none recorded)'} is not in containerd namespace "
                               f"{loc.namespace}",
                               f"pull it there (`{ctr} images pull {image}`) or import it "
                               f"(`{ctr} images import FILE`), then restore again; nothing was "
                               "downloaded")
        if _exists(c, "container", container):
            raise GpusnapError(f"a container named {container} already exists in namespace "
                               f"{loc.namespace}",
                               f"remove it (`{ctr} tasks rm -f {container}; {ctr} containers rm "
                               f"{container}`) or restore with "
                               f"--to containerd://{loc.namespace}/NEW; nothing was downloaded")
    gpu = gpu_planning.plan_here(gpu_manifest, gpu_map,
                    refusal_hint="restore on a host with GPUs like the checkpoint's (`gpusnap "
                                 "inspect` lists them), or name targets with --gpu-map; nothing "
                                 "was downloaded")
    return RestorePlan(address, loc.namespace, container, image, meta.get("runtime") or "", gpu,
                       gpu_map)


def _import(plan: RestorePlan, src: Path, source: str, log_uri: str | None) -> dict:
    """The container made from SRC in the plan's namespace and its task restored; the report."""
    notes = {GPU_MAP_ANNOTATION: plan.gpu_map} if plan.gpu_map else None
    start = time.monotonic()
    with _client(plan.address, plan.namespace) as c:
        try:
            pid = import_dir(c, src, plan.container, stdout=log_uri or "", stderr=log_uri or "",
                             annotations=notes)
        except ContainerdError as exc:
            raise GpusnapError(f"restoring {plan.container} in namespace {plan.namespace} failed: "
                               f"{exc}", f"nothing was left there; {source} is unchanged (the "
                               "shim's log, in containerd's journal, says more)") from None
        except OSError as exc:  # the tar of checkpoint/ beside SRC: a full disk, a read-only DIR
            raise GpusnapError(f"restoring {plan.container} in namespace {plan.namespace} failed: "
                               f"{exc.strerror}: {exc.filename or src.parent}",
                               f"free space there (the restore writes a tar of {src} beside "
                               f"it); {source} is unchanged") from None
    seconds = time.monotonic() - start
    try:
        gpu = restore_check.gpu_report(pid, plan=plan.gpu_plan)
    except restore_check.OffTheGpu as exc:  # its processes cannot run on; the source is untouched
        journal.record("restore-off-the-gpu", container=plan.container, pids=exc.pids,
                       error=exc.message)
        ns, cid, ctr = plan.namespace, plan.container, _ctr(plan.address, plan.namespace)
        raise GpusnapError(f"{exc.message}; task {cid} in namespace {ns} is left running off "
                           f"its GPU; {source} is unchanged", (
                               f"`{ctr} task kill -s SIGKILL {cid}`, `{ctr} task rm -f {cid}`, "
                               f"`{ctr} container rm {cid}`, then restore it again once the GPU "
                               "has the memory free")) from None
    except GpusnapError as exc:  # its check failed otherwise: the task and where it is
        journal.record("restore-check-failed", container=plan.container, error=exc.message)
        raise GpusnapError(f"{exc.message} (task {plan.container} in namespace "
                           f"{plan.namespace})", "`gpusnap doctor --fix`") from None
    moves = plan.gpu_plan.describe() if plan.gpu_plan.needs_remap else None
    journal.record("restored", container=plan.container, namespace=plan.namespace,
                   engine=ENGINE, source=source, seconds=round(seconds, 3), moves=moves)
    result = {"engine": ENGINE, "source": source, "seconds": round(seconds, 3),
              "container": {"id": plan.container, "name": plan.container, "status": "running",
                            "namespace": plan.namespace, "pid": pid, "image": plan.image,
                            "runtime": plan.runtime},
              "gpu_processes": gpu}
    if plan.gpu_plan.moves:
        result["gpus"] = [{"from": m.source.to_dict(), "to": m.target.to_dict(),
                           "why": list(m.reasons)} for m in plan.gpu_plan.moves]
    return result


def write_directory(remote: "Remote", dest: Path, *, use_cache: bool = True,
                    cache_root: Path | None = None, workers: int = 8,
                    progress: "Progress | None" = None,
                    total: Callable[[int], None] | None = None) -> dict:
    """Fetch every chunk (cache first), verify it, and write the files under DEST."""
    from gpusnap.ops.pull import write_files  # registry code (cryptography): a pull only

    return write_files(remote, DirectoryWriter(dest), dest, use_cache=use_cache,
                       cache_root=cache_root, workers=workers, progress=progress, total=total)


def restore_remote(ref_text: str, to: str, name: str | None, opts: "RegistryOptions", *,
                   address: str | None = None, gpu_map: str | None = None, dry_run: bool = False,
                   log_uri: str | None = None, trust: "TrustOptions | None" = None,
                   on_trusted: Callable[[dict], None] | None = None, pull_policy: str = "missing",
                   **kw) -> dict:
    """`gpusnap restore REF --to containerd://NS/ID`: checks, pull into a staged directory,
    import_dir. ``pull_policy``: pull.open_remote's."""
    from gpusnap.ops import pull  # registry code (cryptography): a pull only

    cache = ChunkCache.open(kw.get("cache_root")) if kw.get("use_cache", True) else None
    remote = pull.open_remote(ref_text, opts, trust, cache, pull_policy)
    where = str(remote.client.ref)
    manifest = remote.bundle.gpu_manifest
    plan = plan_restore(remote.bundle.summary, Manifest.from_dict(manifest) if manifest else None,
                        where, to, name, address, gpu_map)
    if dry_run:
        return {**ops_restore.plan_report(where, plan.gpu_plan), "engine": ENGINE,
                "namespace": plan.namespace, "container": plan.container}
    if on_trusted:  # every check passed: the CLI warns of a skipped verification now
        on_trusted(remote.trust)
    work = Path(tempfile.mkdtemp(prefix=PULL_PREFIX,
                                 dir=staging_dir(remote.bundle.total_bytes + (64 << 20))))
    try:
        pulled = write_directory(remote, work / "checkpoint", **kw)
        result = _import(plan, work / "checkpoint", where, log_uri)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["pull"] = pulled
    result["trust"] = remote.trust
    return result


def restore_directory(path: Path, to: str, name: str | None, *, address: str | None = None,
                      gpu_map: str | None = None, dry_run: bool = False,
                      log_uri: str | None = None) -> dict:
    """`gpusnap restore DIR --to containerd://NS/ID`: a directory export_image (or a failed push) left."""
    contents = archive.read_directory(path)
    if not contents.is_containerd_checkpoint:
        refuse_engine(contents.summary(), str(path), ENGINE, to)
        raise GpusnapError(f"{path} is not a containerd checkpoint directory (no containerd.json, "
                           "spec.json and checkpoint/ inside)",
                           "pass the directory a failed `gpusnap push containerd://...` kept")
    plan = plan_restore(contents.summary(), contents.manifest, str(path), to, name, address,
                        gpu_map)
    if dry_run:
        return {**ops_restore.plan_report(str(path), plan.gpu_plan), "engine": ENGINE,
                "namespace": plan.namespace, "container": plan.container}
    return _import(plan, path, str(path), log_uri)
