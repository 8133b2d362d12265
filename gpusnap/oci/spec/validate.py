"""Strict checks of the parts of an OCI spec that the GPU edits touch.

A checkpoint's spec.dump comes from another host and another tool: every field
the modifiers read is checked first, and the result again, so an edit never
writes a spec runc would reject or misread. Errors name the field
(`linux.devices[2].minor`) and what was found.
"""

from __future__ import annotations

from typing import Any

from gpusnap.oci.spec.errors import SpecError

_DEVICE_KEYS = {"path", "type", "major", "minor", "fileMode", "uid", "gid"}
_RULE_KEYS = {"allow", "type", "major", "minor", "access"}
_MOUNT_KEYS = {"destination", "source", "type", "options", "uidMappings", "gidMappings"}
_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer",
          bool: "a boolean", float: "a number", type(None): "null"}


def _kind(value: Any) -> str:
    return _NAMES.get(type(value), type(value).__name__)


def _int(value: Any, where: str, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"spec: {where} is {_kind(value)}, expected an integer")
    if value < minimum:
        raise SpecError(f"spec: {where} is {value}, expected {minimum} or more")


def _obj(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise SpecError(f"spec: {where} is {_kind(value)}, expected an object")


def _list(value: Any, where: str) -> None:
    if not isinstance(value, list):
        raise SpecError(f"spec: {where} is {_kind(value)}, expected an array")


def _abs_path(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise SpecError(f"spec: {where} is {_kind(value)}, expected a path")
    if not value.startswith("/") or "\0" in value:
        raise SpecError(f"spec: {where} {value!r} is not an absolute path")
    if ".." in value.split("/"):
        raise SpecError(f"spec: {where} {value!r} contains '..'")


def _unknown(item: dict, known: set[str], where: str) -> None:
    extra = sorted(set(item) - known)
    if extra:
        raise SpecError(f"spec: {where} has unknown field(s) {', '.join(extra)}")


def validate_devices(devices: Any) -> None:
    if devices is None:
        return
    _list(devices, "linux.devices")
    seen: dict[str, int] = {}
    for i, d in enumerate(devices):
        where = f"linux.devices[{i}]"
        _obj(d, where)
        _unknown(d, _DEVICE_KEYS, where)
        for key in ("path", "type"):
            if key not in d:
                raise SpecError(f"spec: {where} lacks {key}")
        _abs_path(d["path"], f"{where}.path")
        if d["type"] not in ("c", "b", "u", "p"):
            raise SpecError(f"spec: {where}.type is {d['type']!r}, expected one of c, b, u, p")
        if d["type"] != "p":
            for key in ("major", "minor"):
                if key not in d:
                    raise SpecError(f"spec: {where} ({d['path']}) is type {d['type']} but lacks {key}")
                _int(d[key], f"{where}.{key}")
        for key in ("fileMode", "uid", "gid"):
            if key in d:
                _int(d[key], f"{where}.{key}")
        if d["path"] in seen:
            raise SpecError(f"spec: linux.devices[{seen[d['path']]}] and {where} both create "
                            f"{d['path']}")
        seen[d["path"]] = i


def validate_rules(rules: Any) -> None:
    if rules is None:
        return
    _list(rules, "linux.resources.devices")
    for i, r in enumerate(rules):
        where = f"linux.resources.devices[{i}]"
        _obj(r, where)
        _unknown(r, _RULE_KEYS, where)
        if not isinstance(r.get("allow"), bool):
            raise SpecError(f"spec: {where}.allow is {_kind(r.get('allow'))}, expected a boolean")
        if r.get("type") not in (None, "a", "b", "c"):
            raise SpecError(f"spec: {where}.type is {r['type']!r}, expected a, b or c")
        for key in ("major", "minor"):
            if r.get(key) is not None:
                _int(r[key], f"{where}.{key}", minimum=-1)  # -1: any, as runc reads it
        access = r.get("access")
        if access is not None and (not isinstance(access, str) or not access
                                   or set(access) - set("rwm") or len(set(access)) != len(access)):
            raise SpecError(f"spec: {where}.access is {access!r}, expected letters of 'rwm'")


def validate_mounts(mounts: Any) -> None:
    if mounts is None:
        return
    _list(mounts, "mounts")
    for i, m in enumerate(mounts):
        where = f"mounts[{i}]"
        _obj(m, where)
        _unknown(m, _MOUNT_KEYS, where)
        if "destination" not in m:
            raise SpecError(f"spec: {where} lacks destination")
        _abs_path(m["destination"], f"{where}.destination")
        for key in ("source", "type"):
            if key in m and not isinstance(m[key], str):
                raise SpecError(f"spec: {where}.{key} is {_kind(m[key])}, expected a string")
        if "options" in m:
            _list(m["options"], f"{where}.options")
            for j, opt in enumerate(m["options"]):
                if not isinstance(opt, str):
                    raise SpecError(f"spec: {where}.options[{j}] is {_kind(opt)}, expected a string")


def validate_annotations(annotations: Any) -> None:
    if annotations is None:
        return
    _obj(annotations, "annotations")
    for key, value in annotations.items():
        if not isinstance(value, str):
            raise SpecError(f"spec: annotations[{key!r}] is {_kind(value)}, expected a string")


def validate_env(process: Any) -> None:
    if process is None:
        return
    _obj(process, "process")
    env = process.get("env")
    if env is None:
        return
    _list(env, "process.env")
    for i, item in enumerate(env):
        # Never the value itself: the environment holds API keys.
        if not isinstance(item, str):
            raise SpecError(f"spec: process.env[{i}] is {_kind(item)}, expected NAME=VALUE")
        if "=" not in item:
            raise SpecError(f"spec: process.env[{i}] has no '=', expected NAME=VALUE")


def validate_spec(spec: Any) -> None:
    """Raise SpecError on the first malformed field the GPU edits would read or write."""
    _obj(spec, "the top level")
    linux = spec.get("linux")
    if linux is not None:
        _obj(linux, "linux")
        validate_devices(linux.get("devices"))
        resources = linux.get("resources")
        if resources is not None:
            _obj(resources, "linux.resources")
            validate_rules(resources.get("devices"))
        masked = linux.get("maskedPaths")
        if masked is not None:
            _list(masked, "linux.maskedPaths")
    validate_mounts(spec.get("mounts"))
    validate_annotations(spec.get("annotations"))
    validate_env(spec.get("process"))


def device_allowed(rules: list[dict] | None, kind: str, major: int, minor: int) -> bool:
    """Whether the cgroup rules let the container open (kind, major, minor); the last
    matching rule wins, nothing matching means denied (runc's reading)."""
    allowed = False
    for r in rules or []:
        if r.get("type") not in (None, "a", kind):
            continue
        if r.get("major") not in (None, -1, major) or r.get("minor") not in (None, -1, minor):
            continue
        if r.get("allow") and "r" not in (r.get("access") or "rwm"):
            continue  # mknod-only: not an allow for opening
        allowed = bool(r.get("allow"))
    return allowed
