"""Registry credentials (Podman's auth.json and Docker's config.json) and the
Basic/Bearer challenge answers of the distribution API."""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.errors import GpusnapError


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)  # never in a repr or traceback
    source: str  # where they came from, for error messages

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def auth_files(authfile: str | None = None) -> list[Path]:
    """Podman's search order, then Docker's file (`podman login` writes the first
    that applies; `docker login` the last)."""
    if authfile:
        return [Path(authfile)]
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    files.append(Path(f"/run/containers/{os.getuid()}/auth.json"))
    home = Path(os.path.expanduser("~"))
    files.append(home / ".config" / "containers" / "auth.json")
    docker = Path(os.environ["DOCKER_CONFIG"]) if os.environ.get("DOCKER_CONFIG") else home / ".docker"
    files.append(docker / "config.json")
    return files


def _keys(registry: str, repository: str) -> list[str]:
    """auth.json keys from the most specific (host/repo/path) to the host, as Podman does."""
    parts = repository.split("/")
    keys = [f"{registry}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)]
    keys.append(registry)
    if registry in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        keys.append("https://index.docker.io/v1/")
    return keys


def _decode(entry: dict, where: str) -> Credentials | None:
    if entry.get("auth"):
        try:
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise GpusnapError(f"{where}: an 'auth' entry is not base64 of user:password",
                               "log in again (`podman login`)") from None
        return Credentials(user, password, where)
    if entry.get("username") and entry.get("password"):
        return Credentials(entry["username"], entry["password"], where)
    return None


def find_credentials(registry: str, repository: str,
                     authfile: str | None = None) -> Credentials | None:
    for path in auth_files(authfile):
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            if authfile:
                raise GpusnapError(f"no such auth file: {path}",
                                   "pass the file `podman login` wrote (--authfile), or drop "
                                   "--authfile to use the default") from None
            continue
        except (OSError, ValueError) as exc:
            raise GpusnapError(f"cannot read credentials from {path}: {exc}",
                               "fix or remove the file, or pass --username") from None
        auths = data.get("auths") or {}
        # Docker writes hosts with a scheme sometimes ("https://host:5000").
        normalized = {re.sub(r"^https?://", "", k).rstrip("/"): v for k, v in auths.items()}
        for key in _keys(registry, repository):
            entry = auths.get(key) or normalized.get(key)
            if isinstance(entry, dict):
                creds = _decode(entry, str(path))
                if creds is not None:
                    return creds
    return None


_PARAM = re.compile(r'(\w+)=(?:"([^"]*)"|([^\s,]*))')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """'Bearer realm="...",service="..."' -> ("bearer", {realm, service, ...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _PARAM.finditer(rest)}
    return scheme.lower(), params
