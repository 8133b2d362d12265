"""A task's runc options, as containerd's clients send them.

ctr and nerdctl send containerd.runc.v1.Options. containerd's CRI sends those
only to runc's own runtime type; every other one (gpusnap's handler among them)
gets runtimeoptions.v1.Options: the handler's `options` table as TOML (or a
file holding it). Both come out as runc's Options here, so a handler written
as runc's (`SystemdCgroup = true`, kubeadm's default) works the same.
"""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from types import SimpleNamespace

from google.protobuf import any_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from gpusnap.shim.process import ShimError

log = logging.getLogger("gpusnap.shim")

RUNC_OPTIONS = "containerd.runc.v1.Options"
CHECKPOINT_OPTIONS = "containerd.runc.v1.CheckpointOptions"
GENERIC_OPTIONS = "runtimeoptions.v1.Options"
_KINDS = {FieldDescriptor.TYPE_BOOL: (bool, "true or false"), FieldDescriptor.TYPE_STRING: (str, "a string"),
          FieldDescriptor.TYPE_UINT32: (int, "a number")}


def _key(name: str) -> str:
    return name.replace("_", "").lower()  # SystemdCgroup, systemd_cgroup: one field


def _type_name(anyv: any_pb2.Any | None) -> str:
    """ANY's message name ("" for none): containerd's typeurl sends it bare, others with a host."""
    return anyv.type_url.rsplit("/", 1)[-1] if anyv is not None and anyv.value else ""


def runc_options(pb: SimpleNamespace, anyv: any_pb2.Any | None) -> Message:
    """runc's Options from ANY (none, runc's own, or the CRI's generic ones)."""
    opts = pb.runc_options.Options()
    name = _type_name(anyv)
    try:
        if name == RUNC_OPTIONS:
            opts.ParseFromString(anyv.value)
        elif name == GENERIC_OPTIONS:
            generic = pb.runtimeoptions.Options.FromString(anyv.value)
            from_toml(opts, _toml_text(generic), generic.config_path or "the handler's options")
    except DecodeError as e:
        raise ShimError("INVALID_ARGUMENT", f"runtime options ({name}): not a valid message: {e}") from None
    return opts


def checkpoint_options(pb: SimpleNamespace, anyv: any_pb2.Any | None) -> Message:
    """runc's CheckpointOptions from ANY (ctr's `--image-path`, `--exit`...), else the defaults."""
    opts = pb.runc_options.CheckpointOptions()
    if _type_name(anyv) == CHECKPOINT_OPTIONS:
        opts.ParseFromString(anyv.value)
    return opts


def _toml_text(generic: Message) -> str:
    if not generic.config_path:
        return generic.config_body.decode(errors="replace")
    try:
        # O_NONBLOCK: a FIFO named there opens at once and is refused, not waited on by Create
        fd = os.open(generic.config_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ShimError("INVALID_ARGUMENT", f"runtime options: ConfigPath "
                                                    f"{generic.config_path} is not a regular file")
            return f.read()
    except OSError as e:
        raise ShimError("INVALID_ARGUMENT", f"runtime options: cannot read ConfigPath "
                                            f"{generic.config_path}: {e.strerror}") from None


def from_toml(opts: Message, text: str, where: str) -> None:
    """OPTS' fields set from the TOML table TEXT, keys spelt as containerd's runc
    handler spells them; a key no runc option has is logged and left, as
    containerd's runc shim leaves it."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ShimError("INVALID_ARGUMENT", f"runtime options in {where}: not TOML: {e}") from None
    fields = {_key(f.name): f for f in opts.DESCRIPTOR.fields}
    for key, value in table.items():
        f = fields.get(_key(key))
        if f is None or f.type not in _KINDS:
            log.warning("runtime options in %s: %s is not a runc option: left", where, key)
            continue
        kind, words = _KINDS[f.type]
        if type(value) is not kind or (kind is int and not 0 <= value < 2**32):
            raise ShimError("INVALID_ARGUMENT", f"runtime options in {where}: {key} must be {words}, "
                                                f"not {value!r}")
        setattr(opts, f.name, value)
