"""Change which device nodes a running container's cgroup lets it open.

runc puts a container's `linux.resources.devices` rules into its cgroup at
create and never again: `runc update` does not take devices. A live GPU move
(`gpusnap move`) must grant the new GPU's node and take the old one away:

- cgroup v1: write `devices.allow` / `devices.deny` in the container's
  devices cgroup (what runc wrote at create, edited by the same rules).
- cgroup v2: device access is an eBPF program attached to the container's
  cgroup (BPF_CGROUP_DEVICE). A program cannot be edited, so a new one is
  built from the container's rules (the spec's, plus the defaults runc adds to
  every container) and swapped in with BPF_F_REPLACE; the old one is kept open
  so the move can be undone.

Rules are evaluated like runc's: the last rule that matches a request decides,
nothing matching means deny.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gpusnap.errors import GpusnapError
from gpusnap.procs import cgroup_of

# What runc allows every container on top of its spec (libcontainer's
# AllowedDevices): mknod of anything, the standard character nodes, ptys, tun.
RUNC_DEFAULT_RULES: tuple[dict, ...] = (
    {"allow": True, "type": "c", "access": "m"},
    {"allow": True, "type": "b", "access": "m"},
    *({"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
      for major, minor in ((1, 3), (1, 8), (1, 7), (5, 0), (1, 5), (1, 9), (5, 2), (10, 200))),
    {"allow": True, "type": "c", "major": 136, "access": "rwm"},
)


@dataclass(frozen=True)
class Rule:
    allow: bool
    type: str  # "a", "c" or "b"
    major: int  # -1: any
    minor: int  # -1: any
    access: str  # subset of "rwm"

    @classmethod
    def from_spec(cls, d: dict) -> "Rule":
        major, minor = d.get("major"), d.get("minor")
        return cls(bool(d.get("allow")), d.get("type") or "a",
                   -1 if major is None else int(major), -1 if minor is None else int(minor),
                   d.get("access") or "rwm")

    def v1_line(self) -> str:
        num = lambda n: "*" if n < 0 else str(n)  # noqa: E731
        return f"{self.type} {num(self.major)}:{num(self.minor)} {self.access}"


def container_rules(spec: dict) -> list[Rule]:
    """The spec's rules and runc's defaults, in the order runc applies them."""
    linux = spec.get("linux") or {}
    listed = list((linux.get("resources") or {}).get("devices") or [])
    # A node the spec gives the container is reachable under every runc version.
    given = [{"allow": True, "type": d.get("type", "c"), "major": d.get("major"),
              "minor": d.get("minor"), "access": "rwm"}
             for d in linux.get("devices") or [] if d.get("type", "c") in ("c", "b")]
    return [Rule.from_spec(r) for r in listed + given + list(RUNC_DEFAULT_RULES)]


# --- eBPF program for cgroup v2 ---------------------------------------------------------

_ACCESS = {"m": 1, "r": 2, "w": 4}  # BPF_DEVCG_ACC_*
_TYPE = {"b": 1, "c": 2}  # BPF_DEVCG_DEV_*


def _mask(access: str) -> int:
    return sum(_ACCESS[c] for c in set(access) if c in _ACCESS)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


_LDXW, _MOV64_K, _MOV64_X, _AND32_K, _AND64_K, _RSH32_K = 0x61, 0xB7, 0xBF, 0x54, 0x57, 0x74
_JNE_K, _JEQ_K, _EXIT = 0x55, 0x15, 0x95
# registers: r1 ctx; r3 type, r4 access, r5 major, r6 minor, r7 scratch, r0 verdict
_R0, _R1, _R2, _R3, _R4, _R5, _R6, _R7 = range(8)


def _rule_block(rule: Rule) -> list[bytes]:
    """Instructions that return the rule's verdict when it matches, else fall through."""
    tests: list[tuple[int, int, int] | tuple[str, int]] = []
    if rule.type in _TYPE:
        tests.append((_JNE_K, _R3, _TYPE[rule.type]))
    mask = _mask(rule.access)
    if rule.allow and mask != 7:
        tests.append(("allow-mask", 7 & ~mask))  # requested bits outside the rule: no match
    elif not rule.allow:
        tests.append(("deny-mask", mask))  # requested bits inside the rule: match
    if rule.major >= 0:
        tests.append((_JNE_K, _R5, rule.major))
    if rule.minor >= 0:
        tests.append((_JNE_K, _R6, rule.minor))
    body: list[list[bytes]] = []
    for test in tests:
        if test[0] == "allow-mask":
            body.append([_insn(_MOV64_X, _R7, _R4), _insn(_AND64_K, _R7, imm=test[1]),
                         _insn(_JNE_K, _R7, imm=0)])
        elif test[0] == "deny-mask":
            body.append([_insn(_MOV64_X, _R7, _R4), _insn(_AND64_K, _R7, imm=test[1]),
                         _insn(_JEQ_K, _R7, imm=0)])
        else:
            body.append([_insn(test[0], test[1], imm=test[2])])
    tail = [_insn(_MOV64_K, _R0, imm=1 if rule.allow else 0), _insn(_EXIT)]
    out: list[bytes] = []
    left = sum(len(b) for b in body) + len(tail)
    for group in body:
        left -= len(group)
        jump = group[-1]  # the conditional jump is each group's last instruction: skip the rest
        code, regs, _, imm = struct.unpack("<BBhi", jump)
        out += group[:-1] + [struct.pack("<BBhi", code, regs, left, imm)]
    return out + tail


def device_program(rules: list[Rule]) -> bytes:
    """A BPF_PROG_TYPE_CGROUP_DEVICE program: last matching rule wins, default deny."""
    prologue = [
        _insn(_LDXW, _R2, _R1, 0),  # access_type = (access << 16) | type
        _insn(_MOV64_X, _R3, _R2), _insn(_AND32_K, _R3, imm=0xFFFF),
        _insn(_MOV64_X, _R4, _R2), _insn(_RSH32_K, _R4, imm=16),
        _insn(_LDXW, _R5, _R1, 4),  # major
        _insn(_LDXW, _R6, _R1, 8),  # minor
    ]
    blocks = [i for rule in reversed(rules) for i in _rule_block(rule)]
    return b"".join(prologue + blocks + [_insn(_MOV64_K, _R0, imm=0), _insn(_EXIT)])


# --- the bpf(2) system call -------------------------------------------------------------

_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_PROG_LOAD, _PROG_ATTACH, _PROG_GET_FD_BY_ID, _PROG_QUERY = 5, 8, 13, 16
_PROG_TYPE_CGROUP_DEVICE, _CGROUP_DEVICE = 15, 6
_F_ALLOW_MULTI, _F_REPLACE = 2, 4


def _bpf(cmd: int, attr: bytes) -> tuple[int, bytes]:
    """bpf(cmd, attr): the return value and the attr union as the kernel left it."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr, 128)
    number = _SYS_BPF.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, "bpf(2) number unknown for this CPU")
    ret = libc.syscall(number, cmd, buf, 128)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret, buf.raw


def load_program(insns: bytes) -> int:
    """Load a device program; the fd, or OSError with the verifier's log."""
    log = ctypes.create_string_buffer(1 << 16)
    license_ = ctypes.create_string_buffer(b"Apache")
    code = ctypes.create_string_buffer(insns, len(insns))
    attr = struct.pack("<IIQQIIQ", _PROG_TYPE_CGROUP_DEVICE, len(insns) // 8,
                       ctypes.addressof(code), ctypes.addressof(license_), 1, len(log),
                       ctypes.addressof(log))
    try:
        return _bpf(_PROG_LOAD, attr)[0]
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror}: {log.value.decode(errors='replace')[-300:]}") \
            from None


def attached(cgroup_fd: int) -> tuple[list[int], int]:
    """(program ids, attach flags) of the device programs on a cgroup."""
    ids = (ctypes.c_uint32 * 64)()
    attr = struct.pack("<IIIIQI", cgroup_fd, _CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), 64)
    _, out = _bpf(_PROG_QUERY, attr)
    flags, = struct.unpack_from("<I", out, 12)
    count, = struct.unpack_from("<I", out, 24)
    return list(ids[:count]), flags


def program_fd(prog_id: int) -> int:
    return _bpf(_PROG_GET_FD_BY_ID, struct.pack("<III", prog_id, 0, 0))[0]


def attach_program(cgroup_fd: int, prog_fd: int) -> None:
    """Attach as runc does at create (BPF_F_ALLOW_MULTI)."""
    _bpf(_PROG_ATTACH, struct.pack("<IIIII", cgroup_fd, prog_fd, _CGROUP_DEVICE, _F_ALLOW_MULTI, 0))


def replace_program(cgroup_fd: int, new_fd: int, old_fd: int, flags: int) -> None:
    """Swap ``old_fd`` for ``new_fd`` on the cgroup in one step (no moment without a filter)."""
    if flags & _F_ALLOW_MULTI:
        attr = struct.pack("<IIIII", cgroup_fd, new_fd, _CGROUP_DEVICE,
                           _F_ALLOW_MULTI | _F_REPLACE, old_fd)
    else:  # attached without flags: attaching again replaces it
        attr = struct.pack("<IIIII", cgroup_fd, new_fd, _CGROUP_DEVICE, flags, 0)
    _bpf(_PROG_ATTACH, attr)


# --- the container's cgroup ------------------------------------------------------------

@dataclass
class DeviceAccess:
    """A change of a container's device rules that can be undone."""

    pid: int
    cgroup: Path
    version: int
    before: list[Rule]
    after: list[Rule]
    _old_fd: int | None = None

    def check(self) -> None:
        """What ``apply`` and ``undo`` need, before anything changes: on cgroup v2
        the one program runc attached, and the new rules loadable as a program.
        Refused here, a move quiesces nothing; found in ``apply``, the undo
        would fail the same way and leave the processes off their GPUs."""
        if self.version == 1:
            return
        fd = os.open(self.cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _one_program(self.cgroup, attached(fd)[0])
        finally:
            os.close(fd)
        for rules in (self.after, self.before):
            os.close(load_program(device_program(rules)))

    def apply(self) -> None:
        self._set(self.before, self.after, forward=True)

    def undo(self) -> None:
        self._set(self.after, self.before, forward=False)

    def _set(self, current: list[Rule], wanted: list[Rule], forward: bool) -> None:
        if self.version == 1:
            _v1_write(self.cgroup, current, wanted)
            return
        fd = os.open(self.cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ids, flags = attached(fd)
            _one_program(self.cgroup, ids)
            attached_now = program_fd(ids[0])
            if forward:
                new = load_program(device_program(wanted))
                try:
                    replace_program(fd, new, attached_now, flags)
                finally:
                    os.close(new)  # the cgroup holds it now
                self._old_fd = attached_now  # runc's program, kept to undo the move
            else:
                try:
                    self._put_back(fd, attached_now, flags, wanted)
                finally:
                    os.close(attached_now)
        finally:
            os.close(fd)

    def _put_back(self, fd: int, attached_now: int, flags: int, wanted: list[Rule]) -> None:
        """runc's program where this process kept it; else (a change whose process
        is gone, undone by `gpusnap doctor --fix`) one built from the rules before."""
        if self._old_fd is not None:
            replace_program(fd, self._old_fd, attached_now, flags)
            return
        built = load_program(device_program(wanted))
        try:
            replace_program(fd, built, attached_now, flags)
        finally:
            os.close(built)  # the cgroup holds it now

    def close(self) -> None:
        if self._old_fd is not None:
            os.close(self._old_fd)
            self._old_fd = None


def _one_program(cgroup: Path, ids: list[int]) -> None:
    if len(ids) != 1:
        raise GpusnapError(f"the container's cgroup {cgroup} has {len(ids)} device programs, "
                           "not the one runc attaches; its devices were left as they were")


def _v1_write(cgroup: Path, current: list[Rule], wanted: list[Rule]) -> None:
    """cgroup v1 keeps an allow list: deny what is no longer allowed, allow what is new."""
    was = {r.v1_line() for r in current if r.allow}
    now = {r.v1_line() for r in wanted if r.allow}
    for line in sorted(was - now):
        (cgroup / "devices.deny").write_text(line)
    for line in sorted(now - was):
        (cgroup / "devices.allow").write_text(line)


def device_cgroup(pid: int) -> tuple[Path, int]:
    """The cgroup that filters ``pid``'s device access, and the cgroup version."""
    found = cgroup_of(pid, "devices")
    if found is None:
        raise GpusnapError(f"cannot find the device cgroup of process {pid}")
    return found
