"""containerd.task.v3.Task (the gRPC form of the runtime v2 task service), driving runc like containerd's runc shim.

Lifecycle rules kept from containerd's shim: TaskExit of a process is
published only after its TaskStart; the init's TaskExit comes after every
exec's; a Create carrying a checkpoint restores (`runc restore`) at Start.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import shutil
import threading
import time
from typing import Callable

from google.protobuf import any_pb2, empty_pb2

from gpusnap import requests
from gpusnap.errors import GpusnapError
from gpusnap.private import open_private, private_dir
from gpusnap.proto import load
from gpusnap.shim import bundle as bundle_state
from gpusnap.shim import checkpoint as shim_checkpoint
from gpusnap.shim import mounts, oom, stats
from gpusnap.shim.answer import rpc, timestamp as _timestamp
from gpusnap.shim.events import Publisher
from gpusnap.shim.logbinary import BinaryLogger
from gpusnap.shim.options import checkpoint_options, runc_options
from gpusnap.shim.process import Container, Proc, ShimError, not_found, precondition, read_pid
from gpusnap.shim.reaper import Exit, Reaper
from gpusnap.shim.runc import CheckpointOpts, Runc, RuncError
from gpusnap.shim.stdio import Paths, ProcessIO

log = logging.getLogger("gpusnap.shim")

_IO_DRAIN = 5.0  # seconds Delete waits for output to reach the FIFOs
_GONE = ("container not running", "no such process", "does not exist")  # runc's kill, as containerd reads it


class TaskService:
    def __init__(self, namespace: str, publisher: Publisher, reaper: Reaper, on_shutdown: Callable[[], None]) -> None:
        self.pb = load()
        self.namespace = namespace
        self.publisher = publisher
        self.reaper = reaper
        self.on_shutdown = on_shutdown
        self.containers: dict[str, Container] = {}
        self.runcs: dict[str, Runc] = {}
        self.lock = threading.Lock()
        self._exits: queue.Queue = queue.Queue()
        threading.Thread(target=self._exit_loop, name="exits", daemon=True).start()

    # --- helpers -----------------------------------------------------------------

    def _container(self, cid: str) -> Container:
        c = self.containers.get(cid)
        if c is None:
            raise not_found(f"container {cid} not found")
        return c

    def _runc(self, c: Container) -> Runc:
        return self.runcs[c.id]

    def _logger_for(self, c: Container) -> Callable[[str], BinaryLogger]:
        return lambda uri: BinaryLogger(uri, c.id, self.namespace, self.reaper)

    def _publish(self, name: str, **fields) -> None:
        self.publisher.publish(getattr(self.pb.task_events, name)(**fields))

    def _watch(self, c: Container, p: Proc) -> None:
        fut = self.reaper.watch(p.pid)
        fut.add_done_callback(lambda f: self._exits.put((c, p, f.result())))
        if p is c.init:  # the kernel's OOM kills, said as TaskOOM: CRI's "OOMKilled" (oom.py)
            c.oom = oom.watch(c.id, p.pid, functools.partial(self._publish, "TaskOOM", container_id=c.id))

    def _exit_loop(self) -> None:
        while True:
            c, p, ex = self._exits.get()
            threading.Thread(target=self._process_exit, args=(c, p, ex), name="exit", daemon=True).start()

    def _process_exit(self, c: Container, p: Proc, ex: Exit) -> None:
        p.started.wait()
        if p is c.init:
            runc = self.runcs.get(c.id)
            if runc is not None and not c.owns_pid_namespace():
                # Processes sharing the host's (or another) pid namespace outlive init.
                try:
                    runc.kill(c.id, 9, all_procs=True)
                except RuncError as e:
                    log.debug("kill --all after init exit of %s: %s", c.id, e)
            # The init's exit is the container's last event: wait for running execs.
            for e in list(c.execs.values()):
                if e.status in ("running", "paused"):
                    e.published.wait()
        if p is c.init and c.oom is not None:
            # an OOM kill said before the exit, while the cgroup stands: Wait answers
            # once exited is set, and the Delete after it removes the cgroup
            c.oom.check()
        with self.lock:  # Resume's "running" never lands after this
            p.set_exited(ex.status, ex.at_ns)
        if p is c.init:
            requests.drop(p.pid, requests.HELD)  # bound to it: stale from now on anyway
        if p.io is not None:
            p.io.close_stdin()
        self._publish("TaskExit", container_id=c.id, id=p.id, pid=ex.pid, exit_status=ex.status,
                      exited_at=_timestamp(ex.at_ns))
        p.published.set()

    # --- lifecycle ---------------------------------------------------------------

    @rpc
    def Create(self, req, context):
        with self.lock:
            if req.id in self.containers:
                raise ShimError("ALREADY_EXISTS", f"container {req.id} already exists")
            try:
                c, runc = self._new_container(req)
            except BaseException:
                bundle_state.drop_unpacked_checkpoint(req.checkpoint)  # never registered: no Delete will
                raise
            self.containers[c.id] = c
            self.runcs[c.id] = runc
        self._publish("TaskCreate", container_id=c.id, bundle=c.bundle, rootfs=req.rootfs,
                      io=self.pb.task_events.TaskIO(stdin=req.stdin, stdout=req.stdout, stderr=req.stderr,
                                                    terminal=req.terminal),
                      checkpoint=req.checkpoint, pid=c.init.pid)
        return self.pb.shim.CreateTaskResponse(pid=c.init.pid)

    def _new_container(self, req) -> tuple[Container, Runc]:
        opts = runc_options(self.pb, req.options)
        runc = Runc(self.reaper, bundle_state.runc_root(opts.root, self.namespace),
                    os.path.join(req.bundle, "log.json"), opts.binary_name or "runc", opts.systemd_cgroup)
        work = bundle_state.criu_work(req.bundle, opts.criu_work_path, f"{self.namespace}+{req.id}")
        bundle_state.write_state(req.bundle, runc.root, runc.binary, runc.systemd_cgroup, req.checkpoint, work)
        paths = Paths(req.stdin, req.stdout, req.stderr, req.terminal)
        c = Container(req.id, req.bundle, Proc(req.id, paths), checkpoint=req.checkpoint,
                      parent_checkpoint=req.parent_checkpoint, no_pivot=opts.no_pivot_root,
                      no_new_keyring=opts.no_new_keyring, criu_work=work if opts.criu_work_path else "")
        self._create(c, runc, list(req.rootfs))
        return c, runc

    def _create(self, c: Container, runc: Runc, rootfs: list) -> None:
        if rootfs:
            c.rootfs = os.path.join(c.bundle, "rootfs")
            os.makedirs(c.rootfs, mode=0o711, exist_ok=True)
        p = c.init
        try:
            for m in rootfs:
                mounts.mount(m.type, m.source, os.path.join(c.rootfs, m.target.lstrip("/")), list(m.options))
            p.io = ProcessIO(p.paths, self._logger_for(c))
            if c.checkpoint:
                return  # restored at Start, as containerd's runc shim does
            console = p.io.console_socket(c.bundle) if p.paths.terminal else None
            runc.create(c.id, c.bundle, c.pid_file(p), p.io.stdio, console, c.no_pivot, c.no_new_keyring)
            p.io.started()
            p.pid = read_pid(c.pid_file(p))
        except BaseException:
            if p.io is not None:
                p.io.close()
            if p.pid == 0 and not c.checkpoint:
                try:
                    runc.delete(c.id, force=True)
                except RuncError:
                    pass
            if c.rootfs:
                mounts.unmount_all(c.rootfs)
            raise
        self._watch(c, p)

    @rpc
    def Start(self, req, context):
        c = self._container(req.id)
        p = c.process(req.exec_id)
        if p.status != "created":
            raise precondition(f"process {p.id} is {p.status}, not created")
        runc = self._runc(c)
        try:
            if p is c.init:
                if c.checkpoint:
                    self._restore(c, runc)
                else:
                    runc.start(c.id)
                p.status = "running"
                self._publish("TaskStart", container_id=c.id, pid=p.pid)
            else:
                if c.init.exited.is_set():
                    raise precondition(f"container {c.id} init process is not running")
                self._exec_start(c, p, runc)
                p.status = "running"
                self._publish("TaskExecStarted", container_id=c.id, exec_id=p.id, pid=p.pid)
        finally:
            p.restoring = False  # "running" by now, or failed: Delete may go on
            p.started.set()
        return self.pb.shim.StartResponse(pid=p.pid)

    def _restore(self, c: Container, runc: Runc) -> None:
        p = c.init
        assert p.io is not None
        p.restoring = True  # first: a Delete meanwhile would unmount the rootfs under the edits and CRIU
        work = str(private_dir(c.criu_work or bundle_state.criu_work(c.bundle)))  # CRIU's logs: root's
        console = p.io.console_socket(c.bundle) if p.paths.terminal else None
        # Imported here: GPU planning is for restores only and stays out of the shim's startup.
        from gpusnap.shim import remap

        try:
            edits = remap.plan_edits(c.bundle, c.checkpoint)
            if edits is not None:
                remap.apply(c.bundle, c.checkpoint, edits)  # may fail half-way (ENOSPC): undone below
            runc.restore(c.id, c.bundle, c.pid_file(p), p.io.stdio, c.checkpoint, work, console, c.no_pivot,
                         c.parent_checkpoint)
        except BaseException as e:
            with contextlib.suppress(RuncError):  # runc killed leaves its state: "exists" next time
                runc.delete(c.id, force=True)
            remap.undo_after_failure(c.bundle)  # a retry plans on the originals
            # a CRIU killed late leaves its cgroup yard (host cgroups) in `work`, which containerd removes
            from gpusnap.criu import yard  # imported here, as remap is
            yard.release(work)
            if isinstance(e, GpusnapError):  # the plan's refusal (one line, with its hint)
                raise precondition(str(e)) from None
            raise
        p.io.started()
        p.pid = read_pid(c.pid_file(p))
        self._watch(c, p)
        bundle_state.mark_restored(c.bundle)
        # CRIU has read it: containerd 1.7's unpacked copy (GBs for a GPU task) need not wait for Delete
        threading.Thread(target=bundle_state.drop_unpacked_checkpoint, args=(c.checkpoint,), daemon=True).start()

    def _exec_start(self, c: Container, p: Proc, runc: Runc) -> None:
        spec_path = os.path.join(c.bundle, p.file_stem() + ".json")
        with open_private(spec_path, "wb") as f:  # the process's environment: root only
            f.write(p.spec)
        p.io = ProcessIO(p.paths, self._logger_for(c))
        try:
            console = p.io.console_socket(c.bundle) if p.paths.terminal else None
            runc.exec(c.id, spec_path, c.pid_file(p), p.io.stdio, console)
            p.io.started()
            p.pid = read_pid(c.pid_file(p))
        except BaseException:
            p.io.close()
            raise
        finally:
            os.unlink(spec_path)
        self._watch(c, p)

    @rpc
    def Exec(self, req, context):
        c = self._container(req.id)
        with self.lock:
            if req.exec_id in c.execs:
                raise ShimError("ALREADY_EXISTS", f"id {req.exec_id}")
            if c.init.exited.is_set():
                raise precondition(f"container {c.id} init process is not running")
            c.execs[req.exec_id] = Proc(req.exec_id, Paths(req.stdin, req.stdout, req.stderr, req.terminal),
                                        spec=req.spec.value)
        self._publish("TaskExecAdded", container_id=c.id, exec_id=req.exec_id)
        return empty_pb2.Empty()

    @rpc
    def Delete(self, req, context):
        c = self._container(req.id)
        p = c.process(req.exec_id)
        if p.status in ("running", "paused") or p.restoring:  # restoring: CRIU reads its images
            raise precondition(f"cannot delete running process {p.id}")
        p.started.set()
        if p is c.init:
            self._delete_init(c, p)
        else:
            with self.lock:
                c.execs.pop(p.id, None)
            if p.io is not None:
                p.io.wait(_IO_DRAIN)
                p.io.close()
        return self.pb.shim.DeleteResponse(pid=p.pid, exit_status=p.exit_status,
                                           exited_at=_timestamp(p.exited_at_ns))

    def _delete_init(self, c: Container, p: Proc) -> None:
        runc = self._runc(c)
        if not (c.checkpoint and p.pid == 0):
            try:
                runc.delete(c.id, force=not p.exited.is_set())
            except RuncError as e:
                if "does not exist" not in str(e):
                    raise
            if p.pid and not p.exited.wait(5):
                log.warning("init %d of %s not reaped after delete", p.pid, c.id)
        if c.oom is not None:
            c.oom.stop()
        if p.io is not None:
            p.io.wait(_IO_DRAIN)
            p.io.close()
        if c.rootfs:
            mounts.unmount_all(c.rootfs)
        bundle_state.drop_unpacked_checkpoint(c.checkpoint)
        bundle_state.drop_criu_work(c.criu_work, c.id, bool(c.checkpoint) and p.pid == 0)  # the bundle's goes with it
        bundle_state.clear_state(c.bundle)
        with self.lock:
            self.containers.pop(c.id, None)
            self.runcs.pop(c.id, None)
        self._publish("TaskDelete", container_id=c.id, pid=p.pid, exit_status=p.exit_status,
                      exited_at=_timestamp(p.exited_at_ns))

    @rpc
    def Kill(self, req, context):
        c = self._container(req.id)
        p = c.process(req.exec_id)
        if p.exited.is_set():
            raise not_found(f"process {p.id} already finished")
        if p is c.init:
            if p.status == "created":
                p.started.set()  # never started: its exit may be published at once
            if c.checkpoint and p.pid == 0:
                raise precondition(f"container {c.id} is not restored yet")
            try:
                self._runc(c).kill(c.id, req.signal, req.all)
            except RuncError as e:  # exited as runc looked: containerd's shim says NotFound
                if any(w in str(e) for w in _GONE) or p.exited.wait(1.0):
                    raise not_found(f"process {p.id} already finished") from None
                raise
        else:
            if p.pid == 0:
                raise precondition(f"process {p.id} is not started")
            try:
                os.kill(p.pid, req.signal)
            except ProcessLookupError:
                raise not_found(f"process {p.id} already finished") from None
        return empty_pb2.Empty()

    @rpc
    def Wait(self, req, context):
        p = self._container(req.id).process(req.exec_id)
        if not p.wait_exit(context.is_active):
            raise ShimError("CANCELLED", f"wait for {p.id}: the caller went away")  # nobody reads it
        return self.pb.shim.WaitResponse(exit_status=p.exit_status, exited_at=_timestamp(p.exited_at_ns))

    # --- queries -----------------------------------------------------------------

    @rpc
    def State(self, req, context):
        c = self._container(req.id)
        p = c.process(req.exec_id)
        status = self.pb.task_types.Status.Value(p.status.upper())
        return self.pb.shim.StateResponse(
            id=p.id, bundle=c.bundle, pid=p.pid, status=status, stdin=p.paths.stdin, stdout=p.paths.stdout,
            stderr=p.paths.stderr, terminal=p.paths.terminal, exit_status=p.exit_status,
            exited_at=_timestamp(p.exited_at_ns), exec_id=req.exec_id)

    @rpc
    def Pids(self, req, context):
        c = self._container(req.id)
        by_pid = {p.pid: p.id for p in c.execs.values() if p.pid}
        out = []
        for pid in self._runc(c).ps(c.id):
            info = None
            if pid in by_pid:
                details = self.pb.runc_options.ProcessDetails(exec_id=by_pid[pid])
                info = any_pb2.Any(type_url=details.DESCRIPTOR.full_name, value=details.SerializeToString())
            out.append(self.pb.task_types.ProcessInfo(pid=pid, info=info))
        return self.pb.shim.PidsResponse(processes=out)

    @rpc
    def Stats(self, req, context):
        c = self._container(req.id)
        return self.pb.shim.StatsResponse(stats=stats.read(self.pb, self._runc(c), c, stats.cgroup2_host()))

    @rpc
    def Connect(self, req, context):
        c = self.containers.get(req.id)
        return self.pb.shim.ConnectResponse(shim_pid=os.getpid(), task_pid=c.init.pid if c else 0,
                                            version="gpusnap-shim 1")

    # --- control -----------------------------------------------------------------

    def _running_init(self, cid: str) -> tuple[Container, Proc]:
        c = self._container(cid)
        if c.init.status not in ("running", "paused"):
            raise precondition(f"container {cid} is {c.init.status}")
        return c, c.init

    @rpc
    def Pause(self, req, context):
        c, p = self._running_init(req.id)
        self._runc(c).pause(c.id)
        with self.lock:  # an exit meanwhile keeps "stopped": a dead task shown paused stays
            p.status = p.status if p.exited.is_set() else "paused"
        self._publish("TaskPaused", container_id=c.id)
        return empty_pb2.Empty()

    @rpc
    def Resume(self, req, context):
        c, p = self._running_init(req.id)
        if c.dumping:  # it may run for the driver now, and is paused again after
            raise precondition(f"container {c.id} is being checkpointed: resume it after")
        try:
            self._runc(c).resume(c.id)
        except RuncError:
            # thawed under the shim (gpusnap's guardian, its client killed): it runs
            if p.status != "paused" or self._runc(c).state(c.id).get("status") != "running":
                raise
        with self.lock:  # killed while paused (push --stop): it stays stopped
            p.status = p.status if p.exited.is_set() else "running"
        requests.drop(p.pid, requests.HELD)  # the guardian may give the GPUs back now
        self._publish("TaskResumed", container_id=c.id)
        return empty_pb2.Empty()

    @rpc
    def Checkpoint(self, req, context):
        c, p = self._running_init(req.id)
        o = checkpoint_options(self.pb, req.options)
        work = o.work_path or bundle_state.criu_work(c.bundle)
        runc = self._runc(c)
        t0 = time.monotonic()
        # ctr and nerdctl pause the task first, but the driver's lock (pre-dump) needs a CUDA task
        # running: thawed for the dump, held, paused again after it (shim/checkpoint.py). gpusnap's
        # own client quiesces the GPU before its pause (requests.QUIESCED): that one stays paused.
        thawed, dumped, c.dumping = False, False, True
        try:
            if shim_checkpoint.thaw_for_the_driver(p.status, p.pid):
                shim_checkpoint.thaw_held(runc, c.id, p.pid)
                thawed = True
            # The CRIU action script (/etc/criu/runc.conf) quiesces CUDA and writes the GPU manifest.
            shim_checkpoint.dump(runc, c.id, CheckpointOpts(
                image_path=req.path, work_path=work, leave_running=not o.exit, tcp_established=o.open_tcp,
                ext_unix_sk=o.external_unix_sockets, shell_job=o.terminal, file_locks=o.file_locks,
                empty_ns=list(o.empty_namespaces)), os.path.join(c.bundle, "criu-dump.log"),
                frozen_by_client=p.status == "paused" and not thawed)
            dumped = True
        finally:
            if not o.work_path:
                shutil.rmtree(work, ignore_errors=True)
            if thawed and not shim_checkpoint.pause_again(runc, c.id, p.pid, dumped and o.exit):
                self._runs_after_all(c, p)
            c.dumping = False
        log.info("checkpoint of %s into %s took %.2fs", c.id, req.path, time.monotonic() - t0)
        self._publish("TaskCheckpointed", container_id=c.id, checkpoint=req.path)
        return empty_pb2.Empty()

    def _runs_after_all(self, c: Container, p: Proc) -> None:
        """A task that was not paused again and did not exit runs: said so."""
        with self.lock:
            runs = p.status == "paused" and not p.exited.is_set() and os.path.exists(f"/proc/{p.pid}")
            if runs:
                p.status = "running"
        if runs:
            self._publish("TaskResumed", container_id=c.id)

    @rpc
    def Update(self, req, context):
        c, _ = self._running_init(req.id)
        if req.resources.value:
            self._runc(c).update(c.id, req.resources.value)
        return empty_pb2.Empty()

    @rpc
    def ResizePty(self, req, context):
        p = self._container(req.id).process(req.exec_id)
        if p.io is None or p.io.console is None:
            raise precondition(f"process {p.id} has no terminal")
        p.io.resize(req.width, req.height)
        return empty_pb2.Empty()

    @rpc
    def CloseIO(self, req, context):
        p = self._container(req.id).process(req.exec_id)
        if req.stdin and p.io is not None:
            p.io.close_io()
        return empty_pb2.Empty()

    @rpc
    def Shutdown(self, req, context):
        with self.lock:
            if self.containers and not req.now:
                return empty_pb2.Empty()
        self.on_shutdown()
        return empty_pb2.Empty()
