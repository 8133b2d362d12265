"""How the task service answers: its errors as the gRPC status codes
containerd reads, its times as protobuf Timestamps."""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import grpc
from google.protobuf import timestamp_pb2

from gpusnap.shim import mounts
from gpusnap.shim.logbinary import LoggerError
from gpusnap.shim.process import ShimError
from gpusnap.shim.runc import RuncError

log = logging.getLogger("gpusnap.shim")


def timestamp(ns: int) -> timestamp_pb2.Timestamp | None:
    if not ns:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(ns)
    return ts


def rpc(fn: Callable) -> Callable:
    """Map the shim's errors onto gRPC status codes containerd understands."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        t0 = time.monotonic()
        try:
            return fn(self, request, context)
        except ShimError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except (RuncError, mounts.MountError, LoggerError, ValueError) as e:
            log.error("%s: %s", fn.__name__, e)
            context.abort(grpc.StatusCode.UNKNOWN, str(e))
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            log.debug("%s %s took %.1f ms", fn.__name__, getattr(request, "id", ""), (time.monotonic() - t0) * 1000)

    return wrapper
