"""shim/stats.py and the shim's Stats: `runc events --stats` JSON becomes the
cgroups Metrics containerd's clients decode (`ctr task metrics`, `nerdctl
stats`, the CRI). The samples have the shape runc's types.Stats gives (Go's
encoding/json, omitempty: zeros left out) on a cgroup v1 host (runc 1.1) and
a cgroup v2 host (runc 1.2+, with PSI and memory.peak). runc is stood in for;
no integration test runs Stats against containerd yet."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest

from gpusnap.proto import load, wire
from gpusnap.shim import stats
from gpusnap.shim.process import Container, Proc
from gpusnap.shim.reaper import Exit
from gpusnap.shim.runc import Runc, RuncError
from gpusnap.shim.service import TaskService
from gpusnap.shim.stdio import Paths

NO_LIMIT = 2**64 - 1
V1_NO_LIMIT = 9223372036854771712  # memory.limit_in_bytes unset, page-rounded LONG_MAX

RUNC_V1 = {
    "cpu": {"usage": {"total": 2_500_000_000, "percpu": [1_500_000_000, 1_000_000_000, 0, 0],
                      "percpu_kernel": [300_000_000, 200_000_000, 0, 0],
                      "percpu_user": [1_200_000_000, 800_000_000, 0, 0],
                      "kernel": 500_000_000, "user": 2_000_000_000},
            "throttling": {"periods": 120, "throttledPeriods": 7, "throttledTime": 350_000_000}},
    "cpuset": {"cpus": [0, 1, 2, 3], "cpu_exclusive": 0, "mems": [0], "mem_hardwall": 0, "mem_exclusive": 0,
               "memory_migrate": 0, "memory_spread_page": 0, "memory_spread_slab": 0, "memory_pressure": 0,
               "sched_load_balance": 1, "sched_relax_domain_level": -1},
    "memory": {"cache": 8_192_000,
               "usage": {"limit": 536_870_912, "usage": 40_960_000, "max": 52_428_800, "failcnt": 2},
               "swap": {"limit": 1_073_741_824, "usage": 41_000_000, "max": 53_000_000, "failcnt": 0},
               "kernel": {"limit": V1_NO_LIMIT, "usage": 2_097_152, "max": 3_145_728, "failcnt": 0},
               "kernelTCP": {"limit": V1_NO_LIMIT, "failcnt": 0},
               "raw": {"cache": 8_192_000, "rss": 30_000_000, "rss_huge": 2_097_152, "shmem": 0,
                       "mapped_file": 4_096_000, "dirty": 8192, "writeback": 0, "pgpgin": 15_000,
                       "pgpgout": 5_000, "pgfault": 25_000, "pgmajfault": 12, "inactive_anon": 1_000_000,
                       "active_anon": 29_000_000, "inactive_file": 6_000_000, "active_file": 2_192_000,
                       "unevictable": 0, "hierarchical_memory_limit": 536_870_912,
                       "hierarchical_memsw_limit": 1_073_741_824, "total_cache": 8_192_000,
                       "total_rss": 30_000_000, "total_pgpgin": 15_500, "total_pgmajfault": 13,
                       "total_unevictable": 0}},
    "pids": {"current": 3},
    "blkio": {"ioServiceBytesRecursive": [{"major": 8, "op": "Read", "value": 1_048_576},
                                          {"major": 8, "op": "Write", "value": 4096},
                                          {"major": 8, "op": "Total", "value": 1_052_672}],
              "ioServicedRecursive": [{"major": 8, "op": "Read", "value": 40}, {"major": 8, "op": "Write", "value": 1}],
              "ioQueueRecursive": [{"major": 8, "op": "Read"}],
              "sectorsRecursive": [{"major": 8, "minor": 16, "value": 2048}]},
    "hugetlb": {"2MB": {"usage": 4_194_304, "max": 6_291_456, "failcnt": 1}, "1GB": {"failcnt": 0}},
    "intel_rdt": {},
    "network_interfaces": None,
}

RUNC_V2 = {
    "cpu": {"usage": {"total": 2_500_123_456, "kernel": 500_000_000, "user": 2_000_123_000},
            "throttling": {"periods": 120, "throttledPeriods": 7, "throttledTime": 350_000_999},
            "psi": {"some": {"avg10": 1.5, "avg60": 0.25, "avg300": 0, "total": 123_456},
                    "full": {"avg10": 0, "avg60": 0, "avg300": 0, "total": 789}}},
    "cpuset": {"cpu_exclusive": 0, "mem_hardwall": 0, "mem_exclusive": 0, "memory_migrate": 0,
               "memory_spread_page": 0, "memory_spread_slab": 0, "memory_pressure": 0,
               "sched_load_balance": 0, "sched_relax_domain_level": 0},
    # runc adds memory to swap (v1's memsw): memory.swap.current is 1 MiB, memory.swap.max 512 MiB
    "memory": {"cache": 8_192_000,
               "usage": {"limit": 536_870_912, "usage": 40_960_000, "max": 52_428_800, "failcnt": 0},
               "swap": {"limit": 536_870_912 + 536_870_912, "usage": 40_960_000 + 1_048_576, "failcnt": 0},
               "kernel": {"limit": 0, "failcnt": 0}, "kernelTCP": {"limit": 0, "failcnt": 0},
               "raw": {"anon": 30_000_000, "file": 8_192_000, "kernel": 2_500_000, "kernel_stack": 98_304,
                       "pagetables": 200_000, "sock": 0, "shmem": 4096, "file_mapped": 4_096_000,
                       "file_dirty": 8192, "file_writeback": 0, "anon_thp": 2_097_152, "inactive_anon": 1_000_000,
                       "active_anon": 29_000_000, "inactive_file": 6_000_000, "active_file": 2_192_000,
                       "unevictable": 0, "slab_reclaimable": 300_000, "slab_unreclaimable": 200_000,
                       "slab": 500_000, "workingset_refault_anon": 3, "workingset_refault_file": 44,
                       "workingset_activate_anon": 1, "workingset_activate_file": 22,
                       "workingset_nodereclaim": 0, "pgfault": 25_000, "pgmajfault": 12, "pgrefill": 5,
                       "pgscan": 100, "pgsteal": 90, "pgactivate": 7, "pgdeactivate": 6, "pglazyfree": 0,
                       "pglazyfreed": 0, "thp_fault_alloc": 1, "thp_collapse_alloc": 0},
               "psi": {"some": {"avg10": 0.75, "avg60": 0, "avg300": 0, "total": 5000}, "full": {}}},
    "pids": {"current": 5},  # pids.max "max": runc says 0, and omitempty leaves it out
    "blkio": {"ioServiceBytesRecursive": [{"major": 259, "op": "Read", "value": 1_048_576},
                                          {"major": 259, "op": "Write", "value": 4096},
                                          {"major": 8, "minor": 16, "op": "Read", "value": 512}],
              "ioServicedRecursive": [{"major": 259, "op": "Read", "value": 40},
                                      {"major": 259, "op": "Write", "value": 1},
                                      {"major": 8, "minor": 16, "op": "Read", "value": 2}],
              "psi": {"some": {"avg10": 0, "avg60": 0, "avg300": 0, "total": 77}, "full": {}}},
    "hugetlb": {"2MB": {"usage": 4_194_304, "failcnt": 3}, "1GB": {"failcnt": 0}},
    "intel_rdt": {},
    "network_interfaces": None,
}


def _round_trip(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_v1_metrics_carry_runcs_counters():
    m = _round_trip(stats.v1_metrics(load(), RUNC_V1))
    assert (m.pids.current, m.pids.limit) == (3, 0)
    assert (m.cpu.usage.total, m.cpu.usage.kernel, m.cpu.usage.user) == (2_500_000_000, 500_000_000, 2_000_000_000)
    assert list(m.cpu.usage.per_cpu) == [1_500_000_000, 1_000_000_000, 0, 0]
    t = m.cpu.throttling
    assert (t.periods, t.throttled_periods, t.throttled_time) == (120, 7, 350_000_000)
    mem = m.memory
    assert (mem.usage.limit, mem.usage.usage, mem.usage.max, mem.usage.failcnt) == (536_870_912, 40_960_000,
                                                                                   52_428_800, 2)
    assert (mem.swap.limit, mem.swap.usage, mem.swap.max) == (1_073_741_824, 41_000_000, 53_000_000)
    assert (mem.kernel.usage, mem.kernel.limit) == (2_097_152, V1_NO_LIMIT)
    assert m.memory.HasField("kernel_tcp") and mem.kernel_tcp.limit == V1_NO_LIMIT and mem.kernel_tcp.usage == 0
    assert (mem.cache, mem.rss, mem.rss_huge, mem.mapped_file, mem.dirty) == (8_192_000, 30_000_000, 2_097_152,
                                                                              4_096_000, 8192)
    # the fields spelt otherwise than memory.stat
    assert (mem.pg_pg_in, mem.pg_pg_out, mem.pg_fault, mem.pg_maj_fault) == (15_000, 5_000, 25_000, 12)
    assert (mem.hierarchical_memory_limit, mem.hierarchical_swap_limit) == (536_870_912, 1_073_741_824)
    assert (mem.total_pg_pg_in, mem.total_pg_maj_fault, mem.total_rss) == (15_500, 13, 30_000_000)
    b = m.blkio
    assert [(e.op, e.major, e.minor, e.value) for e in b.io_service_bytes_recursive] == [
        ("Read", 8, 0, 1_048_576), ("Write", 8, 0, 4096), ("Total", 8, 0, 1_052_672)]
    assert [e.value for e in b.io_serviced_recursive] == [40, 1]
    assert [(e.op, e.value) for e in b.io_queued_recursive] == [("Read", 0)]  # runc's "ioQueueRecursive"
    assert [(e.op, e.minor, e.value) for e in b.sectors_recursive] == [("", 16, 2048)]
    assert [(h.pagesize, h.usage, h.max, h.failcnt) for h in m.hugetlb] == [
        ("1GB", 0, 0, 0), ("2MB", 4_194_304, 6_291_456, 1)]


def test_v2_metrics_carry_runcs_counters_in_v2s_units():
    m = _round_trip(stats.v2_metrics(load(), RUNC_V2))
    assert (m.pids.current, m.pids.limit) == (5, NO_LIMIT)  # containerd's v2 reader says "max" so
    c = m.cpu
    assert (c.usage_usec, c.user_usec, c.system_usec) == (2_500_123, 2_000_123, 500_000)
    assert (c.nr_periods, c.nr_throttled, c.throttled_usec) == (120, 7, 350_000)
    assert (c.psi.some.avg10, c.psi.some.avg60, c.psi.some.total, c.psi.full.total) == (1.5, 0.25, 123_456, 789)
    mem = m.memory
    assert (mem.usage, mem.usage_limit, mem.max_usage) == (40_960_000, 536_870_912, 52_428_800)
    assert (mem.swap_usage, mem.swap_limit) == (1_048_576, 536_870_912)  # swap alone again
    assert (mem.anon, mem.file, mem.kernel_stack, mem.slab, mem.shmem, mem.file_mapped) == (
        30_000_000, 8_192_000, 98_304, 500_000, 4096, 4_096_000)
    assert (mem.pgfault, mem.pgmajfault, mem.pgscan, mem.pgsteal, mem.thp_fault_alloc) == (25_000, 12, 100, 90, 1)
    assert (mem.workingset_refault_anon, mem.workingset_refault_file, mem.workingset_activate_file) == (3, 44, 22)
    assert mem.workingset_refault == 0  # a kernel before 5.9 has it; this one splits it
    assert (mem.psi.some.avg10, mem.psi.some.total) == (0.75, 5000) and mem.psi.HasField("full")
    assert [(e.major, e.minor, e.rbytes, e.wbytes, e.rios, e.wios) for e in m.io.usage] == [
        (259, 0, 1_048_576, 4096, 40, 1), (8, 16, 512, 0, 2, 0)]
    assert m.io.psi.some.total == 77
    assert [(h.pagesize, h.current, h.failcnt) for h in m.hugetlb] == [("1GB", 0, 0), ("2MB", 4_194_304, 3)]


@pytest.mark.parametrize("memory_max, swap_max, runc_swap_limit", [
    (NO_LIMIT, NO_LIMIT, NO_LIMIT),  # no limits: runc leaves "max" as it is
    (NO_LIMIT, 1 << 30, ((1 << 30) + NO_LIMIT) % 2**64),  # runc's uint64 sum wrapped
    (1 << 29, 0, 1 << 29),  # swap forbidden
])
def test_v2_swap_limit_is_runcs_sum_undone(memory_max, swap_max, runc_swap_limit):
    s = {"memory": {"usage": {"limit": memory_max, "usage": 100}, "swap": {"limit": runc_swap_limit, "usage": 100}}}
    mem = _round_trip(stats.v2_metrics(load(), s)).memory
    assert (mem.usage_limit, mem.swap_limit, mem.swap_usage) == (memory_max, swap_max, 0)


def test_runc_before_psi_and_with_little_to_say_still_gives_every_section():
    # runc 1.1 on v2: no psi, no memory.peak; a created task with no counters yet
    m = _round_trip(stats.v2_metrics(load(), {"cpu": {"usage": {"kernel": 0, "user": 0}}, "memory": {}}))
    assert m.HasField("pids") and m.HasField("cpu") and m.HasField("memory") and m.HasField("io")
    assert not m.cpu.HasField("psi") and not m.memory.HasField("psi") and m.memory.max_usage == 0
    m1 = _round_trip(stats.v1_metrics(load(), {}))
    assert m1.HasField("cpu") and m1.memory.HasField("usage") and m1.memory.HasField("swap")


# Field numbers from containerd/cgroups' cgroup1/stats and cgroup2/stats metrics.proto, read
# off the wire: ctr and nerdctl decode by these, whatever the names in gpusnap's .proto say.
@pytest.mark.parametrize("version, sample, path, value", [
    ("v1", RUNC_V1, (2, 1), 3),  # pids.current
    ("v1", RUNC_V1, (3, 1, 1), 2_500_000_000),  # cpu.usage.total
    ("v1", RUNC_V1, (3, 2, 2), 7),  # cpu.throttling.throttled_periods
    ("v1", RUNC_V1, (4, 2), 30_000_000),  # memory.rss
    ("v1", RUNC_V1, (4, 7), 15_000),  # memory.pg_pg_in
    ("v1", RUNC_V1, (4, 33, 2), 40_960_000),  # memory.usage.usage
    ("v1", RUNC_V1, (4, 34, 1), 1_073_741_824),  # memory.swap.limit
    ("v1", RUNC_V1, (4, 35, 3), 3_145_728),  # memory.kernel.max
    ("v1", RUNC_V1, (5, 1, 5), 1_048_576),  # blkio.io_service_bytes_recursive[0].value
    ("v1", RUNC_V1, (1, 3), 0),  # hugetlb[0].failcnt
    ("v2", RUNC_V2, (1, 1), 5),  # pids.current
    ("v2", RUNC_V2, (2, 1), 2_500_123),  # cpu.usage_usec
    ("v2", RUNC_V2, (2, 6), 350_000),  # cpu.throttled_usec
    ("v2", RUNC_V2, (2, 7, 1, 4), 123_456),  # cpu.psi.some.total
    ("v2", RUNC_V2, (4, 1), 30_000_000),  # memory.anon
    ("v2", RUNC_V2, (4, 32), 40_960_000),  # memory.usage
    ("v2", RUNC_V2, (4, 33), 536_870_912),  # memory.usage_limit
    ("v2", RUNC_V2, (4, 34), 1_048_576),  # memory.swap_usage
    ("v2", RUNC_V2, (4, 36), 52_428_800),  # memory.max_usage
    ("v2", RUNC_V2, (4, 40), 44),  # memory.workingset_refault_file
    ("v2", RUNC_V2, (6, 1, 3), 1_048_576),  # io.usage[0].rbytes
    ("v2", RUNC_V2, (6, 1, 6), 1),  # io.usage[0].wios
    ("v2", RUNC_V2, (7, 4), 0),  # hugetlb[0].failcnt
])
def test_the_wire_has_containerds_field_numbers(version, sample, path, value):
    metrics = stats.v1_metrics if version == "v1" else stats.v2_metrics
    assert _at(metrics(load(), sample).SerializeToString(), path) == value


def _at(data: bytes, path: tuple[int, ...]) -> int:
    """The first varint at the field numbers PATH (nested messages), 0 when absent (proto3 leaves zeros out)."""
    for number, _, value in wire.fields(data):
        if number == path[0]:
            return _at(value, path[1:]) if len(path) > 1 else value
    return 0


def test_the_any_is_named_as_containerds_typeurl_names_it():
    # typeurl.MarshalAny of an unregistered proto message: the bare full name, which ctr
    # (typeurl.Is) and the CRI compare as is; "type.googleapis.com/..." would match neither.
    pb = load()
    for metrics, name in ((stats.v1_metrics(pb, RUNC_V1), "io.containerd.cgroups.v1.Metrics"),
                          (stats.v2_metrics(pb, RUNC_V2), "io.containerd.cgroups.v2.Metrics")):
        a = stats.pack(metrics)
        assert a.type_url == name == metrics.DESCRIPTOR.full_name
        assert type(metrics).FromString(a.value) == metrics


def test_cgroup2_host_is_the_unified_root(tmp_path):
    assert not stats.cgroup2_host(str(tmp_path))  # a v1 or hybrid host: a tmpfs of v1 mounts
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert stats.cgroup2_host(str(tmp_path))


# --- runc events --stats, and the shim's answer -------------------------------------


def _runc(tmp_path, output: str, status: int = 0, error: str = "", systemd: bool = False):
    """A real Runc whose runc writes OUTPUT, logs ERROR (runc's JSON log) and exits STATUS."""
    log_path = tmp_path / "log.json"
    seen: list[list[str]] = []

    def spawn(argv, *, stdin=None, stdout=None, stderr=None):
        seen.append(argv)
        os.write(stdout, output.encode())
        if error:
            with open(log_path, "a") as f:
                f.write(json.dumps({"level": "error", "msg": error}) + "\n")
        done: Future = Future()
        done.set_result(Exit(1, status, 0))
        return 1, done

    return Runc(SimpleNamespace(spawn=spawn), "/run/r", str(log_path), "runc", systemd), seen  # type: ignore[arg-type]


def test_runc_stats_asks_runc_events_for_one_reading(tmp_path):
    event = {"type": "stats", "id": "c1", "data": RUNC_V2}
    runc, seen = _runc(tmp_path, "stray warning on stderr\n" + json.dumps(event) + "\n", systemd=True)
    assert runc.stats("c1") == RUNC_V2
    assert seen[0][:4] == ["runc", "--root", "/run/r", "--systemd-cgroup"]
    assert seen[0][-3:] == ["events", "--stats", "c1"]


def test_runc_stats_without_a_stats_event_says_what_runc_said(tmp_path):
    runc, _ = _runc(tmp_path, json.dumps({"type": "oom", "id": "c1"}) + "\n")
    with pytest.raises(RuncError, match=r"events --stats c1: no stats in its output.*oom"):
        runc.stats("c1")


class Context:
    def abort(self, code, details):
        raise grpc.RpcError(code, details)


@pytest.fixture
def svc(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_STATE_DIR", str(tmp_path / "state"))
    s = TaskService("ns", SimpleNamespace(publish=lambda e: None), None, lambda: None)
    s.containers["c1"] = Container(id="c1", bundle=str(tmp_path),
                                   init=Proc(id="c1", paths=Paths(), pid=4242, status="running"))
    return s


@pytest.mark.parametrize("cgroup2, name", [(False, "io.containerd.cgroups.v1.Metrics"),
                                           (True, "io.containerd.cgroups.v2.Metrics")])
def test_stats_answers_the_hosts_cgroup_metrics(svc, tmp_path, monkeypatch, cgroup2, name):
    monkeypatch.setattr(stats, "cgroup2_host", lambda: cgroup2)
    sample = RUNC_V2 if cgroup2 else RUNC_V1
    svc.runcs["c1"], seen = _runc(tmp_path, json.dumps({"type": "stats", "id": "c1", "data": sample}) + "\n")
    resp = svc.pb.shim.StatsResponse.FromString(
        svc.Stats(SimpleNamespace(id="c1"), Context()).SerializeToString())
    assert resp.stats.type_url == name and seen[0][-3:] == ["events", "--stats", "c1"]
    metrics = svc.pb.cgroups_v2.Metrics if cgroup2 else svc.pb.cgroups_v1.Metrics
    assert metrics.FromString(resp.stats.value).pids.current == sample["pids"]["current"]


@pytest.mark.parametrize("runc_error, code, words", [
    ("container does not exist", grpc.StatusCode.NOT_FOUND, "container c1: runc has no such container"),
    ("container with id c1 is not running", grpc.StatusCode.NOT_FOUND, "container c1 is stopped"),
    ("unable to get container cgroup stats: open /sys/fs/cgroup/x/cpu.stat: no such file or directory",
     grpc.StatusCode.UNKNOWN, "cpu.stat: no such file"),
])
def test_a_refusal_of_runc_is_a_grpc_error_that_says_it(svc, tmp_path, runc_error, code, words):
    svc.runcs["c1"], _ = _runc(tmp_path, "", status=1, error=runc_error)
    with pytest.raises(grpc.RpcError) as e:
        svc.Stats(SimpleNamespace(id="c1"), Context())
    assert e.value.args[0] == code and words in e.value.args[1]


def test_a_task_with_no_cgroup_is_refused_before_runc(svc, tmp_path):
    svc.runcs["c1"], seen = _runc(tmp_path, "")
    c = svc.containers["c1"]
    c.init.set_exited(0, 1)
    with pytest.raises(grpc.RpcError) as e:
        svc.Stats(SimpleNamespace(id="c1"), Context())
    assert e.value.args == (grpc.StatusCode.NOT_FOUND,
                            "container c1 is stopped: runc reads the cgroup of a live container only")
    svc.containers["c2"] = Container(id="c2", bundle=str(tmp_path), init=Proc(id="c2", paths=Paths()),
                                     checkpoint=str(tmp_path / "images"))
    svc.runcs["c2"] = svc.runcs["c1"]
    with pytest.raises(grpc.RpcError) as e:
        svc.Stats(SimpleNamespace(id="c2"), Context())
    assert e.value.args == (grpc.StatusCode.NOT_FOUND, "container c2 is not restored yet: it has no cgroup")
    with pytest.raises(grpc.RpcError) as e:
        svc.Stats(SimpleNamespace(id="c3"), Context())
    assert e.value.args[0] == grpc.StatusCode.NOT_FOUND
    assert seen == []
