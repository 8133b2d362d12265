"""Registry references: HOST[:PORT]/REPO[:TAG][@DIGEST], as Podman and ORAS write them.

The registry part is required: a bare `name:tag` would silently mean Docker
Hub, and would be confused with a container named `name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpusnap.errors import GpusnapError

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}$|^sha512:[a-f0-9]{128}$")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"  # no empty label: "a..b" is a typo
_HOST = re.compile(rf"^(?:\[[0-9a-fA-F:.]+\]|{_LABEL}(?:\.{_LABEL})*)(?::(\d+))?$")
FORM = "HOST[:PORT]/REPOSITORY[:TAG][@sha256:DIGEST]"


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port] as written
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def endpoint(self) -> str:
        """Where the API lives: Docker Hub's name differs from its API host."""
        return "registry-1.docker.io" if self.registry in ("docker.io", "index.docker.io") \
            else self.registry

    @property
    def target(self) -> str:
        """What goes after /manifests/: the digest wins over the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, None, digest)

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def _looks_like_host(part: str) -> bool:
    return part == "localhost" or "." in part or ":" in part or part.startswith("[")


def _userinfo(text: str) -> tuple[str, str] | None:
    """(credentials, HOST/...) of a reference typed as user:password@HOST/REPO (as in
    a URL): a valid one has an @ only before its digest."""
    before, at, after = text.rpartition("@")
    names_host = "/" in after or (_looks_like_host(after) and not after.startswith("sha"))
    if at and ":" in before and names_host and "/" not in before.split(":", 1)[0]:
        return before, after
    return None


def parse(text: str) -> Reference:
    """Parse REF; GpusnapError names what is wrong with it (never a password in it)."""
    creds = _userinfo(text)
    if creds is not None:
        raise GpusnapError(f"{'***@' + creds[1]!r} is not a registry reference: it carries "
                           "credentials (user:password@), which would show in `ps`, shell "
                           "history and logs",
                           "pass --username and --password-stdin, or `podman login "
                           f"{creds[1].split('/', 1)[0]}`")
    bad = f"{text!r} is not a registry reference"
    name, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise GpusnapError(f"{bad}: bad digest {digest!r}", f"write it as {FORM}")
    host, slash, rest = name.partition("/")
    matched = _HOST.match(host)
    if not slash or not _looks_like_host(host) or not matched:
        raise GpusnapError(f"{bad}: it names no registry", f"write it as {FORM}, "
                           "e.g. registry.example.com:5000/ckpt/app:v1")
    if matched[1] is not None and not 0 < int(matched[1]) < 65536:
        raise GpusnapError(f"{bad}: port {matched[1]} is not a port (1-65535)",
                           f"write it as {FORM}, e.g. registry.example.com:5000/ckpt/app:v1")
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG.match(tag):
            raise GpusnapError(f"{bad}: bad tag {tag!r}", f"write it as {FORM}")
    if not _REPO.match(rest) or len(rest) > 255:
        raise GpusnapError(f"{bad}: bad repository name {rest!r} (lowercase letters, "
                           "digits and . _ - / only)", f"write it as {FORM}")
    return Reference(host, rest, tag if tag or digest else "latest", digest or None)


def try_parse(text: str) -> Reference | None:
    """A Reference when ``text`` reads as one, else None (for SOURCE arguments
    that may also be a file or a container)."""
    try:
        return parse(text)
    except GpusnapError:
        return None


def names_registry(text: str) -> bool:
    """Whether ``text`` is meant as a registry reference, valid or not: its first
    part names a host (localhost, a dotted name, an address or a :port) and it
    is not an archive's name. A SOURCE argument that is no file is then parsed
    as a reference, so a typo gets the reference's own error, not "no such file"."""
    host = text.partition("@")[0].partition("/")[0]
    return ("/" in text and _looks_like_host(host) and bool(_HOST.match(host))
            and not text.endswith((".tar", ".zst", ".gz")))
