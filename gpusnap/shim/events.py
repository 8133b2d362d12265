"""Task events forwarded to containerd's events service, in order.

One thread drains a queue and calls containerd.services.events.v1.Events/
Forward on containerd's gRPC socket. An event that cannot be delivered
(containerd restarting) is retried with backoff, so nothing is lost while
containerd is down for less than a few minutes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.protobuf.message import Message

from gpusnap.proto import load
from gpusnap.proto.rpc import unary_stub

log = logging.getLogger("gpusnap.shim")

TOPICS = {
    "TaskCreate": "/tasks/create", "TaskStart": "/tasks/start", "TaskExit": "/tasks/exit",
    "TaskDelete": "/tasks/delete", "TaskExecAdded": "/tasks/exec-added",
    "TaskExecStarted": "/tasks/exec-started", "TaskPaused": "/tasks/paused",
    "TaskResumed": "/tasks/resumed", "TaskCheckpointed": "/tasks/checkpointed", "TaskOOM": "/tasks/oom",
}
_RETRY_FOR = 300.0  # seconds an event is retried before it is dropped


def to_any(msg: Message) -> any_pb2.Any:
    # containerd's typeurl names protobuf events by their full name, no URL prefix.
    return any_pb2.Any(type_url=msg.DESCRIPTOR.full_name, value=msg.SerializeToString())


class Publisher:
    def __init__(self, address: str, namespace: str) -> None:
        self.namespace = namespace
        self._pb = load().events_service
        self._channel = grpc.insecure_channel(f"unix://{address}")
        self._forward = unary_stub(self._channel, self._pb.DESCRIPTOR.services_by_name["Events"], "Forward")
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="events", daemon=True)
        self._thread.start()

    def publish(self, event: Message) -> None:
        ts = timestamp_pb2.Timestamp()
        ts.GetCurrentTime()
        env = self._pb.Envelope(timestamp=ts, namespace=self.namespace,
                                topic=TOPICS[event.DESCRIPTOR.name], event=to_any(event))
        self._queue.put(env)

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty (shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _loop(self) -> None:
        while True:
            env = self._queue.get()
            try:
                self._deliver(env)
            finally:
                self._queue.task_done()

    def _deliver(self, env) -> None:
        deadline = time.monotonic() + _RETRY_FOR
        delay = 0.05
        while True:
            try:
                self._forward(self._pb.ForwardRequest(envelope=env), timeout=5)
                return
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    log.error("dropping event %s: %s", env.topic, e.details() if hasattr(e, "details") else e)
                    return
                log.debug("event %s not delivered, retrying: %s", env.topic, e)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
