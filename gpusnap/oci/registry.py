"""A small client for the OCI distribution API (blobs, manifests, auth), on `requests`.

Not oras-py (see README, Libraries): its uploads read whole blobs into memory,
its downloads are not digest-checked, its retries wait minutes on a dead
registry, and one token is shared unguarded between threads. Here every
request is bounded (chunks are at most a few MiB), safe to call from a pool of
threads, retried with a short backoff on connection errors, and every failure
is one GpusnapError naming the registry.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from typing import Iterable
from urllib.parse import urlencode, urljoin, urlsplit, urlunsplit

from gpusnap.errors import GpusnapError
from gpusnap.oci import stall
from gpusnap.waits import Bound
from gpusnap.oci.auth import Credentials, find_credentials, parse_challenge
from gpusnap.oci.lazy import need
from gpusnap.oci.unreachable import (ITS_SIDE, NOT_IT, TransientError, tls_misconfigured,
                                     unreachable_error)
from gpusnap.oci.reference import Reference
from gpusnap.oci.registry_options import RegistryOptions, tls_verify

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ACCEPT_MANIFESTS = ", ".join([
    OCI_MANIFEST, "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json"])
# GHCR refuses request bodies over 4 MiB: bigger blobs go up in PATCH pieces.
UPLOAD_PIECE = 4 << 20
MANIFEST_LIMIT = 32 << 20
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}



class DigestMismatch(GpusnapError):
    pass


def _shown_url(url: str) -> str:
    """URL as messages show it: scheme, host and path; no user:password@, no query."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _registry_error(resp) -> str:
    """The first error of a distribution error body, else the HTTP status."""
    try:
        err = resp.json()["errors"][0]
        text = f"{err.get('code', '')}: {err.get('message', '')}".strip(": ")
    except Exception:  # noqa: BLE001 -- not JSON: fall back on the status line
        text = ""
    return text or f"HTTP {resp.status_code} {resp.reason}"


def _leave_as_is(request):
    """A requests auth hook that adds nothing (see RegistryClient.__init__)."""
    return request


class RegistryClient:
    """One repository on one registry; methods are thread-safe."""

    def __init__(self, ref: Reference, opts: RegistryOptions, push: bool = False) -> None:
        self.ref = ref
        self.opts = opts
        self.scope = f"repository:{ref.repository}:{'pull,push' if push else 'pull'}"
        self.base = f"{'http' if opts.plain_http else 'https'}://{ref.endpoint}"
        self.verify = False if opts.plain_http else tls_verify(ref.registry, opts)
        if opts.username is not None:
            self.creds: Credentials | None = Credentials(opts.username, opts.password or "",
                                                         "--username")
        else:
            self.creds = find_credentials(ref.registry, ref.repository, opts.authfile)
        self._auth: str | None = None
        self._auth_failed: tuple[str | None, GpusnapError] | None = None  # (sent, its failure)
        self._lock = threading.Lock()
        self._session = None
        self._session_lock = threading.Lock()
        self._stalls = stall.Watchdog(self._timeout[1])

    @property
    def session(self):
        """requests' session, made on the first request: a restore that finds all
        it needs in the host's cache never imports requests (a slow import)."""
        with self._session_lock:
            if self._session is None:
                requests = need("requests")
                if self.verify is False and not self.opts.plain_http:
                    need("urllib3").disable_warnings(
                        need("urllib3.exceptions").InsecureRequestWarning)
                session = requests.Session()
                # One pooled connection per worker thread, plus the main thread's.
                adapter = requests.adapters.HTTPAdapter(pool_connections=2, pool_maxsize=32)
                session.mount("https://", adapter)
                session.mount("http://", adapter)
                session.headers["User-Agent"] = "gpusnap"
                # Our Authorization header is set per request; without a session auth,
                # requests looks for ~/.netrc on every request (a real share of a
                # push's CPU over hundreds of chunks). Proxies from the environment still apply.
                session.auth = _leave_as_is
                self._session = session
            return self._session

    @property
    def _exc(self):
        return need("requests").exceptions

    # -- plumbing ------------------------------------------------------------------

    def url(self, path: str) -> str:
        return f"{self.base}/v2/{self.ref.repository}/{path}"

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def _tls_misconfigured(self, exc: Exception) -> bool:
        return isinstance(exc, self._exc.SSLError) and tls_misconfigured(str(exc))

    def _unreachable(self, exc: Exception, what: str | None = None) -> GpusnapError:
        return unreachable_error(exc, self._exc, self.ref.registry, self.opts.retries, self._timeout, what)

    @property
    def _timeout(self) -> tuple[float, float]:
        """(connect, read): a registry that takes the connection and then sends
        nothing is given up on after the read bound, each try."""
        read = Bound.of("REGISTRY").seconds
        return (min(10.0, read), read)

    def request(self, method: str, url: str, *, retry: bool = True, stream: bool = False,
                headers: dict | None = None, data=None, ok: tuple[int, ...] = ()):
        """Send with auth; retry connection errors and 5xx/429 when ``retry``.

        Returns the response (status in ``ok``, or any status when ``ok`` is empty).
        """
        attempts = self.opts.retries if retry else 1
        authed_again = False
        attempt = 0
        while True:
            hdrs = dict(headers or {})
            sent_auth = self._auth
            if sent_auth:
                hdrs["Authorization"] = sent_auth
            try:
                resp = self.session.request(method, url, headers=hdrs, data=data,
                                            stream=stream, verify=self.verify,
                                            timeout=self._timeout, allow_redirects=True)
            except (self._exc.ConnectionError, self._exc.Timeout,
                    self._exc.ChunkedEncodingError) as exc:
                if self._tls_misconfigured(exc):
                    raise self._unreachable(exc) from None
                attempt += 1
                if attempt >= attempts:
                    raise self._unreachable(exc) from None
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
                continue
            except self._exc.RequestException as exc:
                raise self._failed(method, url, exc) from None
            if resp.status_code == 401 and not authed_again:
                resp.close()
                self._authenticate(resp, sent_auth)
                authed_again = True
                continue
            if resp.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                resp.close()
                attempt += 1
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
                continue
            if resp.status_code == 400 and "HTTP request to an HTTPS server" in resp.text:
                raise GpusnapError(f"registry {self.ref.registry} serves HTTPS",
                                   "drop --plain-http")
            if resp.status_code == 401:
                raise self._denied(resp)
            if resp.status_code == 403:
                raise GpusnapError(f"registry {self.ref.registry} denied {method} on "
                                   f"{self.ref.repository}: {_registry_error(resp)}",
                                   "check that this account may "
                                   f"{'push to' if 'push' in self.scope else 'pull from'} it")
            if ok and resp.status_code not in ok:
                said = (f"registry {self.ref.registry}: {method} {urlsplit(url).path} "
                        f"failed: {_registry_error(resp)}")
                if resp.status_code >= 500:  # the registry's own fault: its storage, often full
                    raise TransientError(f"{said} (HTTP {resp.status_code})",
                                         "the registry failed on its side: look at its log "
                                         "and its free space")
                kind = TransientError if resp.status_code in _RETRY_STATUS else GpusnapError
                raise kind(said)
            return resp

    def _failed(self, method: str, url: str, exc: Exception) -> GpusnapError:
        """Any other requests error, by its type only: its text may quote a header
        (InvalidHeader repeats the Authorization value) or a URL with its query."""
        return GpusnapError(f"registry {self.ref.registry}: {method} {urlsplit(url).path} "
                            f"failed: {type(exc).__name__}")

    def _denied(self, resp) -> GpusnapError:
        who = f"user {self.creds.username!r} ({self.creds.source})" if self.creds else "anonymous"
        if self.creds is None:
            return GpusnapError(f"registry {self.ref.registry} requires a login",
                                "pass --username and --password-stdin, or `podman login "
                                f"{self.ref.registry}`")
        return GpusnapError(f"registry {self.ref.registry} refused the credentials of {who}: "
                            f"{_registry_error(resp)}",
                            f"check them, or log in again with `podman login {self.ref.registry}`")

    def _authenticate(self, resp, sent_auth: str | None) -> None:
        """Answer a 401 challenge (Basic or Bearer token); once per header value."""
        with self._lock:
            if self._auth != sent_auth:  # another thread already answered it
                return
            if self._auth_failed is not None and self._auth_failed[0] == sent_auth:
                raise copy.copy(self._auth_failed[1])  # failed while this waited: not each in turn
            try:
                self._answer_challenge(resp)
            except GpusnapError as exc:
                self._auth_failed = (sent_auth, exc)
                raise

    def _answer_challenge(self, resp) -> None:
        scheme, params = parse_challenge(resp.headers.get("WWW-Authenticate", ""))
        if scheme == "basic":
            if self.creds is None:
                raise self._denied(resp)
            self._auth = self.creds.basic_header()
        elif scheme == "bearer":
            self._auth = "Bearer " + self._token(params)
        else:
            raise GpusnapError(f"registry {self.ref.registry} asks for unsupported "
                               f"authentication {scheme or '(none given)'!r}")

    def _token(self, params: dict[str, str]) -> str:
        realm = params.get("realm")
        if not realm:
            raise GpusnapError(f"registry {self.ref.registry} gave a token challenge without realm")
        query = {"scope": self.scope}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": self.creds.basic_header()} if self.creds else {}
        url = f"{realm}?{urlencode(query)}"
        shown = _shown_url(realm)  # the registry chose it: it may carry anything
        resp = self._token_answer(url, headers, shown)
        if resp.status_code in (401, 403):
            raise self._denied(resp)
        if resp.status_code != 200:
            said = f"token service {shown} of registry {self.ref.registry} answered {_registry_error(resp)}"
            if resp.status_code in _RETRY_STATUS:
                raise TransientError(f"{said} (after {self.opts.retries} tries)")
            raise GpusnapError(said)
        try:
            body = resp.json()
        except ValueError:
            raise GpusnapError(f"token service {shown} answered something other than "
                               "JSON") from None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not token or not isinstance(token, str):
            raise GpusnapError(f"token service {shown} returned no token")
        return token

    def _token_answer(self, url: str, headers: dict, shown: str):
        """The token service's answer, tried as a registry request is (a blip as tokens
        expire mid-push failed it all); named as itself: it may be another host."""
        attempt = 0
        while True:
            try:
                resp = self.session.get(url, headers=headers, verify=self.verify,
                                        timeout=self._timeout)
            except (self._exc.ConnectionError, self._exc.Timeout) as exc:
                attempt += 1
                if self._tls_misconfigured(exc) or attempt >= self.opts.retries:
                    raise self._unreachable(exc, f"the token service {shown} of registry "
                                                 f"{self.ref.registry}") from None
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
                continue
            except self._exc.RequestException as exc:
                raise self._failed("GET", shown, exc) from None
            if resp.status_code in _RETRY_STATUS and attempt + 1 < self.opts.retries:
                resp.close()
                attempt += 1
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
                continue
            return resp

    # -- API -----------------------------------------------------------------------

    def ping(self) -> None:
        """Check reachability and credentials before any work is done."""
        resp = self.request("GET", f"{self.base}/v2/")
        if resp.status_code == 404:  # a web server on that port, or a typo in it
            raise GpusnapError(f"{self.ref.registry} is not an OCI registry (no /v2/ API)", NOT_IT)
        if resp.status_code != 200:
            raise GpusnapError(f"registry {self.ref.registry}: {_registry_error(resp)}",
                               ITS_SIDE if resp.status_code >= 500 else NOT_IT)
        if "bearer" in (self._auth or "").lower():
            return
        # Basic registries accept /v2/ anonymously at times; a HEAD in the repository
        # makes wrong credentials fail here and not after gigabytes were read.
        self.request("HEAD", self.url("tags/list"))

    def blob_exists(self, digest: str) -> bool:
        resp = self.request("HEAD", self.url(f"blobs/{digest}"))
        resp.close()
        if resp.status_code >= 500:
            # Still failing after the retries: a registry killed while linking a
            # blob answers 500 for it from then on (docker-registry reads an empty
            # link file). Sending the blob again is always safe, and its PUT
            # rewrites the link; refusing would leave the push stuck for good.
            return False
        if resp.status_code not in (200, 404):
            raise GpusnapError(f"registry {self.ref.registry}: HEAD blob {digest[:19]} "
                               f"answered HTTP {resp.status_code}")
        return resp.status_code == 200

    def put_blob(self, digest: str, data: bytes | bytearray) -> None:
        """Upload one blob (POST, then one PUT or PATCH pieces + PUT).

        A session that broke half way is restarted from the POST: its pieces
        are a few MiB, cheaper to resend than to resume.
        """
        attempt = 0
        while True:
            try:
                self._upload(digest, data)
                return
            except TransientError:
                attempt += 1
                if attempt >= self.opts.retries:
                    raise
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))

    def _upload(self, digest: str, data: bytes | bytearray) -> None:
        octet = {"Content-Type": "application/octet-stream"}
        start = self.request("POST", self.url("blobs/uploads/"), retry=False, ok=(202, 201),
                             headers={"Content-Length": "0"})
        if start.status_code == 201:
            return
        location = urljoin(self.url(""), start.headers["Location"])
        if len(data) > UPLOAD_PIECE:
            view = memoryview(data)  # pieces are views, not copies of the blob
            for off in range(0, len(data), UPLOAD_PIECE):
                piece = view[off:off + UPLOAD_PIECE]
                resp = self.request("PATCH", location, retry=False, data=piece, ok=(202,),
                                    headers={**octet, "Content-Range": f"{off}-{off + len(piece) - 1}",
                                             "Content-Length": str(len(piece))})
                location = urljoin(location, resp.headers.get("Location", location))
            data = b""
        parts = urlsplit(location)
        query = (parts.query + "&" if parts.query else "") + urlencode({"digest": digest})
        self.request("PUT", urlunsplit(parts._replace(query=query)), retry=False, ok=(201,),
                     data=data, headers={**octet, "Content-Length": str(len(data))})

    def put_blob_stream(self, pieces: Iterable[bytes]) -> tuple[str, int]:
        """Upload a blob while it is being made: PATCH pieces of at most
        UPLOAD_PIECE as they come, the digest only in the closing PUT.
        (digest, size). A broken connection fails it: a stream cannot be
        sent again, the caller starts over."""
        start = self.request("POST", self.url("blobs/uploads/"), ok=(202,),
                             headers={"Content-Length": "0"})
        location = urljoin(self.url(""), start.headers["Location"])
        octet = {"Content-Type": "application/octet-stream"}
        h = hashlib.sha256()
        buf = bytearray()
        size = 0

        def send(data: bytes) -> None:
            nonlocal location, size
            resp = self.request("PATCH", location, retry=False, data=data, ok=(202,),
                                headers={**octet, "Content-Range": f"{size}-{size + len(data) - 1}",
                                         "Content-Length": str(len(data))})
            location = urljoin(location, resp.headers.get("Location", location))
            size += len(data)

        for piece in pieces:
            h.update(piece)
            buf += piece
            while len(buf) >= UPLOAD_PIECE:
                send(bytes(buf[:UPLOAD_PIECE]))
                del buf[:UPLOAD_PIECE]
        if buf:
            send(bytes(buf))
        digest = "sha256:" + h.hexdigest()
        parts = urlsplit(location)
        query = (parts.query + "&" if parts.query else "") + urlencode({"digest": digest})
        self.request("PUT", urlunsplit(parts._replace(query=query)), retry=False, ok=(201,),
                     data=b"", headers={**octet, "Content-Length": "0"})
        return digest, size

    def get_blob(self, digest: str, size: int) -> bytearray:
        """The blob's bytes, checked against ``digest``; at most ``size`` are read."""
        attempt = 0
        while True:
            resp = self.request("GET", self.url(f"blobs/{digest}"), stream=True)
            watch = self._stalls.watch(resp)
            try:
                if resp.status_code == 404:
                    raise GpusnapError(f"registry {self.ref.registry} lacks blob {digest} of "
                                       f"{self.ref}", "push the checkpoint again")
                if resp.status_code != 200:
                    raise GpusnapError(f"registry {self.ref.registry}: GET blob {digest[:19]}: "
                                       f"{_registry_error(resp)}")
                # Filled in place (sized by Content-Length, which must not exceed
                # ``size``): growing a buffer and copying it out would hold two or
                # three copies of each blob.
                length = int(resp.headers.get("Content-Length") or 0)
                buf = bytearray(min(length, size))
                got = 0
                for piece in resp.iter_content(stall.PIECE):
                    watch.progress(len(piece))
                    if got + len(piece) > size:
                        raise DigestMismatch(f"blob {digest} from {self.ref.registry} is longer "
                                             f"than the {size} bytes the manifest says",
                                             damaged(digest))
                    buf[got:got + len(piece)] = piece
                    got += len(piece)
                if watch.stalled and got < size:  # a body whose end is the connection's
                    raise self._exc.ConnectionError("cut off: too slow")
                break
            except (self._exc.ConnectionError, self._exc.ChunkedEncodingError) as exc:
                attempt += 1
                if attempt >= self.opts.retries:
                    raise (TransientError(*stall.words(self.ref.registry, digest, self.opts.retries,
                                                       self._stalls.seconds))
                           if watch.stalled else self._unreachable(exc)) from None
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
            finally:
                watch.close()
                resp.close()
        del buf[got:]  # a short body: the digest check below names it
        check_digest(buf, digest, f"blob {digest} from {self.ref.registry}")
        return buf

    def get_manifest(self, target: str | None = None) -> tuple[bytes, str, str]:
        """(body, media type, digest) of the reference's manifest."""
        target = target or self.ref.target
        resp = self.request("GET", self.url(f"manifests/{target}"),
                            headers={"Accept": ACCEPT_MANIFESTS})
        if resp.status_code == 404:
            what = "digest" if target.startswith("sha") else "tag"
            raise GpusnapError(f"{self.ref}: no such {what} in {self.ref.registry}/"
                               f"{self.ref.repository} ({_registry_error(resp)})",
                               f"list the tags with `oras repo tags{self.opts.oras_flags()} "
                               f"{self.ref.registry}/{self.ref.repository}`")
        if resp.status_code != 200:
            raise GpusnapError(f"{self.ref}: {_registry_error(resp)}")
        body = resp.content
        if len(body) > MANIFEST_LIMIT:
            raise GpusnapError(f"{self.ref}: manifest of {len(body)} bytes is too large")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if target.startswith("sha256:"):
            check_digest(body, target, f"manifest {target} from {self.ref.registry}")
        media = resp.headers.get("Content-Type", "").split(";")[0].strip()
        return body, media, digest

    def head_manifest(self, target: str) -> dict | None:
        """A descriptor of a manifest in this repository, or None when it is not there."""
        resp = self.request("HEAD", self.url(f"manifests/{target}"),
                            headers={"Accept": ACCEPT_MANIFESTS})
        resp.close()
        if resp.status_code != 200:
            return None
        return {"mediaType": resp.headers.get("Content-Type", OCI_MANIFEST).split(";")[0],
                "digest": resp.headers.get("Docker-Content-Digest", target),
                "size": int(resp.headers.get("Content-Length", 0))}

    def put_manifest(self, body: bytes, media_type: str, target: str) -> str:
        resp = self.request("PUT", self.url(f"manifests/{target}"), data=body,
                            headers={"Content-Type": media_type}, ok=(201, 200))
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        returned = resp.headers.get("Docker-Content-Digest")
        if returned and returned != digest:
            raise GpusnapError(f"registry {self.ref.registry} stored the manifest as {returned}, "
                               f"expected {digest}")
        return digest


def damaged(digest: str) -> str:
    """What repairs a blob whose bytes the registry serves damaged. A registry
    keeps a blob it has (content-addressed, it takes a re-upload for the same
    bytes), so pushing again alone sends nothing: the blob goes first."""
    algo, _, hexd = digest.partition(":")
    return (f"the registry's copy of blob {digest[:19]} is damaged, and a push sends nothing it "
            "has: remove that blob on the registry's side (docker-registry: the folder "
            f"docker/registry/v2/blobs/{algo}/{hexd[:2]}/{hexd} in its storage), then push the "
            "checkpoint again (only that blob is sent)")


def check_digest(data: bytes | bytearray, digest: str, what: str) -> None:
    algo, _, expected = digest.partition(":")
    if algo not in ("sha256", "sha512"):
        raise GpusnapError(f"{what}: unsupported digest algorithm {algo!r}")
    got = hashlib.new(algo, data).hexdigest()
    if got != expected:
        raise DigestMismatch(f"{what} does not match its digest (got {algo}:{got[:12]}...)",
                             damaged(digest))
