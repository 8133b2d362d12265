"""The registry flags every command takes (Podman's and ORAS's names), the
same flags in those tools' words for the commands gpusnap prints, and the TLS
verification they ask for.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.errors import GpusnapError

_SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass
class RegistryOptions:
    """The registry flags every command takes (Podman/ORAS names)."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr or traceback
    authfile: str | None = None
    insecure: bool = False  # skip TLS verification (--tls-verify=false)
    plain_http: bool = False
    ca_file: str | None = None
    retries: int = 4
    backoff_s: float = 0.5

    def podman_flags(self) -> str:
        """These options in Podman's words, for a printed `podman pull` (a
        password is asked by Podman itself, never printed)."""
        flags = ["--tls-verify=false"] if self.plain_http or self.insecure else []
        if self.ca_file and not flags and self.ca_file.endswith(".crt"):
            # Podman takes a folder of CA files, each *.crt, not a file
            flags.append(f"--cert-dir {shlex.quote(str(Path(self.ca_file).absolute().parent))}")
        if self.username:
            flags.append(f"--creds {shlex.quote(self.username)}")
        elif self.authfile:
            flags.append(f"--authfile {shlex.quote(self.authfile)}")
        return "".join(" " + f for f in flags)

    def oras_flags(self) -> str:
        """These options in ORAS's words, for a printed `oras` command that must
        work as printed (a password is read from stdin, never printed)."""
        flags = ["--plain-http"] if self.plain_http else ["--insecure"] if self.insecure else []
        if self.ca_file and not self.plain_http:
            flags.append(f"--ca-file {shlex.quote(self.ca_file)}")
        if self.username:
            flags.append(f"--username {shlex.quote(self.username)} --password-stdin")
        elif self.authfile:
            flags.append(f"--registry-config {shlex.quote(self.authfile)}")
        return "".join(" " + f for f in flags)


def tls_verify(registry: str, opts: RegistryOptions) -> bool | str:
    if opts.insecure:
        return False
    if opts.ca_file:
        if not Path(opts.ca_file).is_file():
            raise GpusnapError(f"no such CA file: {opts.ca_file}",
                               "pass the path of the CA certificate that signed the registry's")
        return opts.ca_file
    # Podman's per-registry CA, then the system store (Podman and ORAS trust it; certifi does not).
    for base in ("/etc/containers/certs.d", "/etc/docker/certs.d"):
        ca = Path(base) / registry / "ca.crt"
        if ca.is_file():
            return str(ca)
    return str(_SYSTEM_CA) if _SYSTEM_CA.is_file() else True
