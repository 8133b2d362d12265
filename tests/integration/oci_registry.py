"""A real distribution registry (Debian's docker-registry) on loopback for the tests:
storage in a temp dir, htpasswd (bcrypt) auth, TLS with a self-signed certificate
for 127.0.0.1 and localhost, on a free port; or plain HTTP without auth, as
`make demo` runs one."""

from __future__ import annotations

import json
import random
import shutil
import socket
import ssl
import struct
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

USER = "gpusnap"
PASSWORD = "s3cret-pass"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _htpasswd(user: str, password: str) -> str:
    if shutil.which("htpasswd"):
        return subprocess.run(["htpasswd", "-Bbn", user, password], capture_output=True,
                              text=True, check=True, timeout=60).stdout.strip() + "\n"
    import bcrypt  # apache2-utils missing: same $2y$ bcrypt line

    # Cost 5, htpasswd -B's default: docker-registry checks the hash on every
    # request, and at cost 10 a chunked push of 3 GB cost it 253 CPU-seconds
    # (H200 host, 2026-11-23) against ORAS's few requests: a bench artefact.
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
    return f"{user}:{hashed.replace('$2b$', '$2y$', 1)}\n"


def _certificate(d: Path) -> tuple[Path, Path]:
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   capture_output=True, check=True, timeout=60)
    return cert, key


@dataclass
class Registry:
    root: Path
    port: int
    ca: Path | None  # None: plain HTTP, no login
    proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    def ref(self, name: str) -> str:
        return f"{self.host}/{name}"

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def flags(self) -> list[str]:
        """gpusnap's flags for this registry (password on stdin)."""
        if self.ca is None:
            return ["--plain-http"]
        return ["--ca-file", str(self.ca), "--username", USER, "--password-stdin"]

    def oras_flags(self) -> list[str]:
        return ["--ca-file", str(self.ca), "--username", USER, "--password", PASSWORD]

    def start(self) -> "Registry":
        log = open(self.root / "registry.log", "ab")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.root / "config.yml")],
                                     stdout=log, stderr=log, start_new_session=True)
        ctx = ssl.create_default_context(cafile=str(self.ca)) if self.ca else None
        scheme = "https" if self.ca else "http"
        deadline = time.monotonic() + 60  # a loaded CI host (2 cores) may take longer
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{scheme}://{self.host}/v2/", context=ctx, timeout=2)
                return self
            except urllib.error.HTTPError as exc:
                if exc.code == 401:  # up, and asking for the login
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"docker-registry did not start: {(self.root / 'registry.log').read_text()}")

    def kill(self) -> None:
        """SIGKILL, as a crash or a pulled plug would stop it (storage kept)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def linked_blobs(self, repository: str) -> set[str]:
        """Blobs the repository holds: what a HEAD there answers 200 for."""
        layers = self.storage / "docker/registry/v2/repositories" / repository / "_layers/sha256"
        if not layers.is_dir():
            return set()
        # A registry killed while writing a link leaves it empty: HEAD answers 500
        # for that blob, so it does not count as held.
        return {f"sha256:{p.name}" for p in layers.glob("*")
                if _read(p / "link") == f"sha256:{p.name}"
                and (self.storage / "docker/registry/v2/blobs/sha256" / p.name[:2] / p.name
                     / "data").is_file()}

    def tags(self, repository: str) -> set[str]:
        """The tags the repository has (its tag links in storage)."""
        tags = self.storage / "docker/registry/v2/repositories" / repository / "_manifests/tags"
        return {p.name for p in tags.iterdir()} if tags.is_dir() else set()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_registry(root: Path, readonly: bool = False, plain: bool = False) -> Registry:
    """Started; ``readonly`` refuses uploads (a push fails after its checks passed);
    ``plain``: HTTP and no login, as `make demo`'s."""
    if shutil.which("docker-registry") is None:
        raise RuntimeError("docker-registry is not installed (make deps)")
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    if plain:
        (root / "config.yml").write_text(f"""version: 0.1
log: {{level: warn, accesslog: {{disabled: true}}}}
storage: {{filesystem: {{rootdirectory: {root / 'storage'}}}}}
http: {{addr: 127.0.0.1:{port}, secret: gpusnap-test-{port}}}
""")
        return Registry(root, port, None).start()
    cert, key = _certificate(root)
    (root / "htpasswd").write_text(_htpasswd(USER, PASSWORD))
    (root / "config.yml").write_text(f"""version: 0.1
log: {{level: warn, accesslog: {{disabled: true}}}}
storage:
  filesystem: {{rootdirectory: {root / 'storage'}}}
  delete: {{enabled: true}}
  maintenance: {{readonly: {{enabled: {str(readonly).lower()}}}}}
http:
  addr: 127.0.0.1:{port}
  secret: gpusnap-test-{port}
  tls: {{certificate: {cert}, key: {key}}}
auth:
  htpasswd: {{realm: gpusnap-test, path: {root / 'htpasswd'}}}
""")
    return Registry(root, port, cert).start()


def permissive_policy(directory: Path) -> Path:
    """A trust policy accepting unsigned checkpoints (docs/trust.md), for tests and
    benches whose restores are not about trust: point GPUSNAP_POLICY at it."""
    path = directory / "policy-accept-anything.json"
    path.write_text(json.dumps({"default": {"type": "insecureAcceptAnything"}}))
    path.chmod(0o644)  # as root, a policy others can write is refused
    return path


def make_large_checkpoint(root: Path, size: int, seed: int = 1) -> int:
    """A Podman-shaped checkpoint directory with ``size`` bytes of memory pages that
    neither compress nor deduplicate, written fast: a 32 MiB random period whose
    every 64 KiB is stamped with a running block number (no two chunks of the
    chunker's minimum size are equal, and zstd finds no repeat inside one chunk,
    the period being longer than the largest chunk; a segment's short last
    chunk may fall between two stamps and repeat). Returns the directory's
    total bytes."""
    ckpt = root / "checkpoint"
    ckpt.mkdir(parents=True)
    name = f"large-{seed}"
    (root / "config.dump").write_text(json.dumps({
        "id": f"{seed:064x}", "name": name, "rootfsImageName": "localhost/gpusnap-demo:latest",
        "runtime": "runc", "createdTime": "2026-11-23T00:00:00Z"}))
    (root / "spec.dump").write_text(json.dumps({"ociVersion": "1.0.2", "linux": {}}))
    (root / "stats-dump").write_bytes(b"\x00" * 64)
    rng = random.Random(seed)
    for small in ("inventory.img", "core-1.img", "mm-1.img", "pagemap-1.img", "files.img"):
        (ckpt / small).write_bytes(rng.randbytes(4096 + rng.randrange(60000)))
    period = 32 << 20
    base = bytearray(rng.randbytes(period))
    stamp = struct.Struct("<QQ")
    block = 0
    with open(ckpt / "pages-1.img", "wb") as f:
        left = size
        while left > 0:
            for off in range(0, period, 65536):
                stamp.pack_into(base, off, seed, block)
                block += 1
            n = min(left, period)
            f.write(memoryview(base)[:n])
            left -= n
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""
