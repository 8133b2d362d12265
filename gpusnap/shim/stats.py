"""The shim's Stats: a container's cgroup counters, in the message containerd's
clients decode (`ctr task metrics`, `nerdctl stats`, the CRI's stats).

runc reads the cgroup (`runc events --stats`), wherever it is: v1, v2 or a
systemd scope. This module renames runc's JSON (its types.Stats) into
containerd/cgroups' Metrics, v1 or v2 as the host mounts cgroups, which is what
containerd's runc shim answers after reading the same files itself. What runc
does not report is left unset (gpusnap_pb/cgroups_v*.proto say which).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from google.protobuf import any_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from gpusnap.shim.process import Container, ShimError, not_found
from gpusnap.shim.runc import Runc, RuncError

CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 2**64 - 1  # what containerd's v2 reader makes of "max"

# v1 Metrics fields spelt otherwise than their memory.stat key; every other
# counter field is the key of its name.
_V1_MEMORY_KEYS = {
    "pg_pg_in": "pgpgin", "pg_pg_out": "pgpgout", "pg_fault": "pgfault", "pg_maj_fault": "pgmajfault",
    "hierarchical_swap_limit": "hierarchical_memsw_limit",
    "total_pg_pg_in": "total_pgpgin", "total_pg_pg_out": "total_pgpgout", "total_pg_fault": "total_pgfault",
    "total_pg_maj_fault": "total_pgmajfault",
}
# v2 MemoryStat's uint64 fields read from memory.{current,max,peak,swap.*}, not memory.stat.
_V2_MEMORY_FILES = frozenset({"usage", "usage_limit", "swap_usage", "swap_limit", "max_usage"})
# v1 BlkIOStat's lists, by runc's JSON names (its own spelling: "ioQueueRecursive").
_V1_BLKIO = {
    "io_service_bytes_recursive": "ioServiceBytesRecursive", "io_serviced_recursive": "ioServicedRecursive",
    "io_queued_recursive": "ioQueueRecursive", "io_service_time_recursive": "ioServiceTimeRecursive",
    "io_wait_time_recursive": "ioWaitTimeRecursive", "io_merged_recursive": "ioMergedRecursive",
    "io_time_recursive": "ioTimeRecursive", "sectors_recursive": "sectorsRecursive",
}


def cgroup2_host(root: str = CGROUP_ROOT) -> bool:
    """True when ROOT is a cgroup v2 mount (unified): only a cgroup2 root has
    cgroup.controllers; a v1 or hybrid host has a tmpfs of v1 mounts there."""
    return os.path.exists(os.path.join(root, "cgroup.controllers"))


def read(pb: SimpleNamespace, runc: Runc, c: Container, cgroup2: bool) -> any_pb2.Any:
    """The Any a StatsResponse carries for C's cgroup, or the gRPC error that says why there is none."""
    # NOT_FOUND: containerd's Metrics skips such a task quietly (the kubelet asks every few seconds)
    if c.init.exited.is_set():
        raise not_found(f"container {c.id} is stopped: runc reads the cgroup of a live container only")
    if c.checkpoint and c.init.pid == 0:  # restored at Start
        raise not_found(f"container {c.id} is not restored yet: it has no cgroup")
    try:
        stats = runc.stats(c.id)
    except RuncError as e:
        raise _refusal(c.id, e) from None
    return pack(v2_metrics(pb, stats) if cgroup2 else v1_metrics(pb, stats))


def _refusal(cid: str, e: RuncError) -> ShimError | RuncError:
    # runc's words (libcontainer): "container does not exist", "container with id X is not running"
    if "does not exist" in str(e):
        return not_found(f"container {cid}: runc has no such container ({e})")
    if "is not running" in str(e):  # exited since the shim looked
        return not_found(f"container {cid} is stopped: {e}")
    return e


def pack(metrics: Message) -> any_pb2.Any:
    """METRICS as containerd's typeurl packs it: the type URL is the bare full name
    ("io.containerd.cgroups.v1.Metrics"), which `ctr task metrics` compares as is."""
    return any_pb2.Any(type_url=metrics.DESCRIPTOR.full_name, value=metrics.SerializeToString())


def v1_metrics(pb: SimpleNamespace, stats: dict) -> Message:
    """runc's types.Stats as io.containerd.cgroups.v1.Metrics: the same units, mostly the same names."""
    m = pb.cgroups_v1.Metrics()
    _fill(m.pids, stats.get("pids"), current="current", limit="limit")  # no limit: 0 in both
    cpu = stats.get("cpu") or {}
    usage = cpu.get("usage") or {}
    _fill(m.cpu.usage, usage, total="total", kernel="kernel", user="user")
    m.cpu.usage.per_cpu.extend(usage.get("percpu") or [])
    _fill(m.cpu.throttling, cpu.get("throttling"), periods="periods", throttled_periods="throttledPeriods",
          throttled_time="throttledTime")
    memory = stats.get("memory") or {}
    _counters(m.memory, memory.get("raw") or {}, _V1_MEMORY_KEYS)
    for field, key in (("usage", "usage"), ("swap", "swap"), ("kernel", "kernel"), ("kernel_tcp", "kernelTCP")):
        _fill(getattr(m.memory, field), memory.get(key), limit="limit", usage="usage", max="max", failcnt="failcnt")
    blkio = stats.get("blkio") or {}
    m.blkio.SetInParent()
    for field, key in _V1_BLKIO.items():
        for e in blkio.get(key) or []:
            getattr(m.blkio, field).add(op=e.get("op", ""), major=e.get("major", 0), minor=e.get("minor", 0),
                                        value=e.get("value", 0))
    for size, h in sorted((stats.get("hugetlb") or {}).items()):
        m.hugetlb.add(pagesize=size, usage=h.get("usage", 0), max=h.get("max", 0), failcnt=h.get("failcnt", 0))
    return m


def v2_metrics(pb: SimpleNamespace, stats: dict) -> Message:
    """runc's types.Stats as io.containerd.cgroups.v2.Metrics: cpu.stat's microseconds (runc
    gives nanoseconds), swap without memory, io per device, as the v2 files say them."""
    m = pb.cgroups_v2.Metrics()
    pids = stats.get("pids") or {}
    m.pids.current = pids.get("current", 0)
    m.pids.limit = pids.get("limit") or _NO_LIMIT  # runc says "max" as 0
    cpu = stats.get("cpu") or {}
    usage, throttling = cpu.get("usage") or {}, cpu.get("throttling") or {}
    m.cpu.usage_usec = usage.get("total", 0) // 1000
    m.cpu.user_usec = usage.get("user", 0) // 1000
    m.cpu.system_usec = usage.get("kernel", 0) // 1000
    m.cpu.nr_periods = throttling.get("periods", 0)
    m.cpu.nr_throttled = throttling.get("throttledPeriods", 0)
    m.cpu.throttled_usec = throttling.get("throttledTime", 0) // 1000
    _psi(m.cpu.psi, cpu.get("psi"))
    _v2_memory(m.memory, stats.get("memory") or {})
    _v2_io(m.io, stats.get("blkio") or {})
    for size, h in sorted((stats.get("hugetlb") or {}).items()):
        m.hugetlb.add(pagesize=size, current=h.get("usage", 0), failcnt=h.get("failcnt", 0))
    return m


def _v2_memory(msg: Message, memory: dict) -> None:
    msg.SetInParent()
    _counters(msg, memory.get("raw") or {}, {}, skip=_V2_MEMORY_FILES)
    usage, swap = memory.get("usage") or {}, memory.get("swap") or {}
    msg.usage, msg.usage_limit = usage.get("usage", 0), usage.get("limit", 0)
    msg.max_usage = usage.get("max", 0)  # memory.peak: runc 1.2+, kernel 5.19+
    # runc (1.0+) adds memory to v2's swap, as v1's memsw counts it: taken off again. Its limit
    # sum wraps at 2^64 as Go's uint64 does; a "max" swap limit it leaves "max" (so does a swap
    # limit of 0 under no memory limit: the one sum that cannot be undone). Without swap
    # accounting both come out 0, as containerd says a missing memory.swap.* file.
    msg.swap_usage = max(swap.get("usage", 0) - msg.usage, 0)
    swap_limit = swap.get("limit", 0)
    msg.swap_limit = swap_limit if swap_limit == _NO_LIMIT else (swap_limit - msg.usage_limit) % 2**64
    _psi(msg.psi, memory.get("psi"))


def _v2_io(msg: Message, blkio: dict) -> None:
    """io.stat's lines again: runc split each into v1-style Read and Write lists of bytes and of ios."""
    msg.SetInParent()
    devices: dict[tuple[int, int], Message] = {}
    for key, fields in (("ioServiceBytesRecursive", ("rbytes", "wbytes")), ("ioServicedRecursive", ("rios", "wios"))):
        for e in blkio.get(key) or []:
            if e.get("op") not in ("Read", "Write"):
                continue
            dev = (e.get("major", 0), e.get("minor", 0))
            if dev not in devices:
                devices[dev] = msg.usage.add(major=dev[0], minor=dev[1])
            setattr(devices[dev], fields[e["op"] == "Write"], e.get("value", 0))
    _psi(msg.psi, blkio.get("psi"))


def _fill(msg: Message, values: dict | None, **keys: str) -> None:
    """MSG's FIELD=KEY pairs from runc's JSON; a key runc left out (omitempty) is 0.
    MSG is set even when all are 0, as containerd sets it."""
    msg.SetInParent()
    for field, key in keys.items():
        setattr(msg, field, (values or {}).get(key, 0))


def _counters(msg: Message, raw: dict, keys: dict[str, str], skip: frozenset[str] = frozenset()) -> None:
    """memory.stat's counters: each uint64 field of MSG (but SKIP) takes the key of its name,
    or KEYS' for it; a field added to the .proto is filled with no change here."""
    for f in msg.DESCRIPTOR.fields:
        if f.type == FieldDescriptor.TYPE_UINT64 and f.name not in skip:
            setattr(msg, f.name, raw.get(keys.get(f.name, f.name), 0))


def _psi(msg: Message, psi: dict | None) -> None:
    """Pressure (runc 1.2+ reads *.pressure); left unset when runc gave none, as containerd does."""
    if not psi:
        return
    for side in ("some", "full"):
        _fill(getattr(msg, side), psi.get(side), avg10="avg10", avg60="avg60", avg300="avg300", total="total")
