"""The serving shim process: the task service on a unix socket, over gRPC
(containerd 1.7) or ttrpc (containerd 2.x: see ttrpc.py)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from gpusnap.private import private_umask, write_private
from gpusnap.proto import load
from gpusnap.proto.rpc import generic_handler
from gpusnap.shim.events import Publisher
from gpusnap.shim.logfifo import setup_logging
from gpusnap.shim.reaper import Reaper, set_subreaper
from gpusnap.shim.service import TaskService
from gpusnap.shim.ttrpc import TtrpcServer

log = logging.getLogger("gpusnap.shim")


def _set_name(name: bytes) -> None:
    # ps shows "gpusnap-shim" rather than the python (or zygote) it came from
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def serve(namespace: str, containerd_address: str, socket_path: str, ready_fd: int, debug: bool,
          origin: str = "cold", protocol: str = "grpc") -> int:
    """Serve until Shutdown; write one byte to READY_FD once listening."""
    setup_logging(os.path.join(os.getcwd(), "log"), debug)
    threading.excepthook = lambda a: log.error("thread %s: %s", a.thread.name if a.thread else "?",
                                               a.exc_value, exc_info=(a.exc_type, a.exc_value, a.exc_traceback))
    set_subreaper()
    reaper = Reaper()
    reaper.start()
    done = threading.Event()
    service = TaskService(namespace, Publisher(containerd_address, namespace), reaper, done.set)
    task = load().shim.DESCRIPTOR.services_by_name["Task"]
    if protocol == "ttrpc":
        server = TtrpcServer(task, service)
        if not server.listen(socket_path):
            return 1
        stop = server.stop
    else:
        # Wait() holds a worker until its process exits or its caller leaves: keep plenty.
        grpc_server = grpc.server(ThreadPoolExecutor(max_workers=64, thread_name_prefix="rpc"))
        grpc_server.add_generic_rpc_handlers((generic_handler(task, service),))
        # 0600: containerd connects as root; nobody else may drive this shim's containers.
        with private_umask():
            bound = grpc_server.add_insecure_port(f"unix:{socket_path}")
        if bound == 0:
            log.error("cannot listen on %s", socket_path)
            return 1
        grpc_server.start()
        stop = lambda: grpc_server.stop(grace=0.5).wait()  # noqa: E731
    info = os.path.splitext(socket_path)[0] + ".json"
    # who serves this socket, for operators and tests
    write_private(info, json.dumps({"pid": os.getpid(), "address": containerd_address,
                                    "namespace": namespace, "bundle": os.getcwd(),
                                    "origin": origin, "protocol": protocol}))
    _set_name(b"gpusnap-shim")
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    log.debug("serving %s on %s (pid %d, %s start)", protocol, socket_path, os.getpid(), origin)
    done.wait()
    service.publisher.flush(5.0)
    stop()
    for f in (socket_path, info):
        try:
            os.unlink(f)
        except OSError:
            pass
    ru = resource.getrusage(resource.RUSAGE_SELF)
    log.debug("shim exiting (cpu %.0f ms user, %.0f ms system)", ru.ru_utime * 1000, ru.ru_stime * 1000)
    sys.stdout.flush()
    return 0
