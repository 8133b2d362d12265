"""Which keys are trusted for which registries and repositories:
/etc/gpusnap/policy.json ($GPUSNAP_POLICY, or a path given to load()).

    {
      "default": {"type": "reject"},
      "scopes": {
        "registry.example.com": {"type": "signedBy", "keyPaths": ["/etc/gpusnap/keys/ci.pub"]},
        "registry.example.com/ckpt/dev": {"type": "insecureAcceptAnything"},
        "localhost:5000/ckpt": {"type": "signedBy", "keyData": ["-----BEGIN PUBLIC KEY-----..."],
                                "signedIdentity": "matchDigestOnly"}
      }
    }

Like containers-policy.json: a scope is a registry (host[:port]) or a
registry/repository prefix on path boundaries ("reg/ckpt" covers "reg/ckpt/app",
not "reg/ckpt2"); the longest matching scope wins, else "default".
"insecureAcceptAnything" is the explicit opt-out for a scope. With no policy
file, what a key in /etc/gpusnap/keys/trusted/ signed is accepted (this
host's own key is there: trust/hostkey.py), nothing else; unsigned
checkpoints are refused unless the user passes --insecure-policy.

Validation is strict: an unknown field, a wrong type or an unreadable key is
an error naming the field (`policy.json: scopes["reg/x"].keyPaths[0]: ...`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.errors import GpusnapError
from gpusnap.oci.reference import Reference
from gpusnap.trust import hostkey, keys

DEFAULT_PATH = Path("/etc/gpusnap/policy.json")
POLICY_ENV = "GPUSNAP_POLICY"
TYPES = ("signedBy", "insecureAcceptAnything", "reject")
IDENTITIES = ("matchRepository", "matchDigestOnly")
# Same grammar as gpusnap/oci/reference.py (host[:port], lowercase path components)
_HOST = re.compile(r"^(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::\d+)?$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_FIELDS = {"signedBy": {"type", "keyPaths", "keyData", "signedIdentity"},
           "insecureAcceptAnything": {"type"}, "reject": {"type"}}


@dataclass
class Requirement:
    type: str
    scope: str  # "default" or the scope that matched
    keys: dict[str, keys.PublicKey] = field(default_factory=dict)  # key id -> public key
    match_repository: bool = True

    def __repr__(self) -> str:
        return (f"Requirement({self.type!r}, scope={self.scope!r}, "
                f"keys={sorted(keys.short_id(k) for k in self.keys)})")


@dataclass
class Policy:
    default: Requirement
    scopes: dict[str, Requirement]
    source: Path | None  # None: no policy file: this host's trusted keys (hostkey.py), if any

    @property
    def where(self) -> str | None:
        """What decided, for --json and the restore's line."""
        if self.source is not None:
            return str(self.source)
        return f"{hostkey.trusted_dir()} (no policy file)" if self.default.keys else None

    def for_reference(self, ref: Reference) -> Requirement:
        """The requirement of the longest scope that covers REF."""
        name = f"{ref.registry}/{ref.repository}"
        best = None
        for scope in self.scopes:
            if (name == scope or name.startswith(scope + "/")) and \
                    (best is None or len(scope) > len(best)):
                best = scope
        return self.scopes[best] if best is not None else self.default


def load(path: str | Path | None = None) -> Policy:
    """The policy; a missing file at the default place means "reject everything",
    a missing file that was named explicitly is an error."""
    explicit = path or os.environ.get(POLICY_ENV)
    p = Path(explicit) if explicit else DEFAULT_PATH
    try:
        st = os.stat(p)
        text = p.read_bytes()
    except FileNotFoundError:
        if explicit:
            raise GpusnapError(f"no policy file {p}", "write one (docs/trust.md) or drop "
                               f"{POLICY_ENV}") from None
        trusted = hostkey.trusted()  # what this host and `gpusnap key trust` vouched for
        if trusted:
            return Policy(Requirement("signedBy", "default", trusted), {}, None)
        return Policy(Requirement("reject", "default"), {}, None)
    except OSError as exc:
        raise GpusnapError(f"cannot read the policy {p}: {exc.strerror}") from None
    if os.geteuid() == 0 and stat.S_IMODE(st.st_mode) & 0o022:
        # whoever can write the policy decides what root restores
        raise GpusnapError(f"the policy {p} can be written by other users "
                           f"(mode {stat.S_IMODE(st.st_mode):04o})", f"chmod go-w {p}")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise GpusnapError(f"{p}: not valid JSON ({exc})", "fix the file (docs/trust.md)") from None
    return parse(doc, p)


def parse(doc: Any, source: Path) -> Policy:
    where = str(source)
    _object(doc, where)
    _known(doc, {"default", "scopes"}, where)
    if "default" not in doc:
        _fail(where, 'has no "default" requirement',
              'add "default": {"type": "reject"} (or "signedBy" with keys)')
    default = _requirement(doc["default"], f"{where}: default", "default", source.parent)
    scopes: dict[str, Requirement] = {}
    raw = doc.get("scopes", {})
    _object(raw, f"{where}: scopes")
    for scope, req in raw.items():
        at = f"{where}: scopes[{json.dumps(scope)}]"
        _check_scope(scope, at)
        scopes[scope] = _requirement(req, at, scope, source.parent)
    return Policy(default, scopes, source)


def _requirement(doc: Any, at: str, scope: str, base: Path) -> Requirement:
    _object(doc, at)
    kind = doc.get("type")
    if kind not in TYPES:
        _fail(f"{at}.type", f"is {json.dumps(kind)}", f"use one of {', '.join(TYPES)}")
    _known(doc, _FIELDS[kind], at)
    if kind != "signedBy":
        return Requirement(kind, scope)
    identity = doc.get("signedIdentity", "matchRepository")
    if identity not in IDENTITIES:
        _fail(f"{at}.signedIdentity", f"is {json.dumps(identity)}",
              f"use one of {', '.join(IDENTITIES)}")
    found: dict[str, keys.PublicKey] = {}
    for name in ("keyPaths", "keyData"):
        items = doc.get(name, [])
        if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
            _fail(f"{at}.{name}", "is not a list of non-empty strings",
                  "keyPaths: PEM public key files; keyData: PEM public keys inline")
        for i, item in enumerate(items):
            here = f"{at}.{name}[{i}]"
            try:
                if name == "keyPaths":
                    path = base / item if not os.path.isabs(item) else Path(item)
                    key = keys.load_public_key(path)
                else:
                    key = keys.load_public_key(data=item.encode(), where="the inline key")
            except GpusnapError as exc:
                _fail(here + ":", exc.message, exc.hint)
            if keys.kind(key) not in keys.KEY_TYPES:
                _fail(here, f"is a {keys.kind(key)} key, which cannot sign",
                      "trust Ed25519 or ECDSA P-256 keys")
            found[keys.key_id(key)] = key
    if not found:
        _fail(at, "is signedBy with no keys", 'list the trusted public keys in "keyPaths"')
    return Requirement(kind, scope, found, identity == "matchRepository")


def _check_scope(scope: str, at: str) -> None:
    host, _, path = scope.partition("/")
    parts = path.split("/") if path else []
    if not _HOST.match(host) or not all(_COMPONENT.match(c) for c in parts) or \
            scope.endswith("/"):
        _fail(at, "is not a scope", "write HOST[:PORT] or HOST[:PORT]/REPOSITORY-PREFIX, "
              "no tag or digest, e.g. registry.example.com:5000/ckpt")


def _object(doc: Any, at: str) -> None:
    if not isinstance(doc, dict):
        _fail(at, f"is a {type(doc).__name__}, not an object", "see docs/trust.md")


def _known(doc: dict, allowed: set[str], at: str) -> None:
    extra = sorted(set(doc) - allowed)
    if extra:
        _fail(at, f"has unknown field(s) {', '.join(extra)}",
              f"allowed here: {', '.join(sorted(allowed))}")


def _fail(at: str, what: str, hint: str | None = None) -> None:
    raise GpusnapError(f"{at} {what}", hint)
