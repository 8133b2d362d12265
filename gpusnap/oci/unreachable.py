"""Why a registry cannot be reached, in words a user can act on.

requests wraps what the socket met (a down link, a blackholed route, a
registry that died mid-answer) in a ConnectionError whose class says
nothing; its text does.
"""

from __future__ import annotations

import re

from gpusnap.errors import GpusnapError

_SOCKET_WHYS = (("network is unreachable", "network unreachable"),
                ("no route", "no route to host"),
                ("connection reset", "connection reset"),
                ("broken pipe", "connection cut"),
                ("connection aborted", "connection cut"),
                ("remotedisconnected", "connection cut"))


def socket_why(text: str, read_s: float) -> str | None:
    """A short reason for a connection error's ``text``, else None. A timeout
    names its own bound where the text has it (``connect timeout=10``), else
    ``read_s``."""
    low = text.lower()
    if "timed out" in low or "timeouterror" in low:  # a blackholed link
        bound = re.search(r"(connect|read) timeout=([\d.]+)", low)
        what = "connection" if bound and bound[1] == "connect" else "answer"
        return f"no {what} within {float(bound[2]) if bound else read_s:.0f} s"
    return next((why for cue, why in _SOCKET_WHYS if cue in low), None)


ITS_SIDE = "the registry failed on its side: try again, or look at its log"
NOT_IT = "check the registry's HOST:PORT in the reference (and --plain-http for plain HTTP)"
CUT_SHORT_HINT = ("run the command again (what arrived is kept); should it repeat, look at the "
                  "registry's log and at proxies between")


def tls_misconfigured(text: str) -> bool:
    """Whether an SSLError's ``text`` is one another try cannot fix (certificate,
    plain HTTP), as opposed to a connection cut during a handshake or a read (a
    registry that died: SSL EOF errors), which is retried like any cut connection."""
    low = text.lower()
    return any(s in low for s in ("certificate verify failed", "wrong version number",
                                  "doesn't match", "unknown ca", "bad certificate"))


class TransientError(GpusnapError):
    """The registry could not be reached or answered 5xx/429: worth another try."""


def unreachable_error(exc: Exception, exceptions, registry: str, retries: int,
                      timeout: tuple[float, float], what: str | None = None) -> GpusnapError:
    """``exc``, requests' error (of module ``exceptions``) for a request that
    met no answer after ``retries`` tries, in words (``what``: the host's
    name in them, the registry's where not given)."""
    text = str(exc)
    what = what or f"registry {registry}"
    if isinstance(exc, exceptions.SSLError) and tls_misconfigured(text):
        if "WRONG_VERSION_NUMBER" in text.upper() or "wrong version number" in text:
            return GpusnapError(f"registry {registry} does not speak TLS",
                                "pass --plain-http for a registry served over plain HTTP")
        why = "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in text else "TLS error"
        return GpusnapError(f"TLS connection to registry {registry} failed: {why}",
                            "pass --ca-file FILE (the registry's CA) or --tls-verify=false")
    if "refused" in text.lower():
        why = "connection refused"
    elif isinstance(exc, exceptions.ConnectTimeout):
        why = f"no connection within {timeout[0]:.0f} s"
    elif isinstance(exc, exceptions.Timeout):
        why = f"it sent nothing for {timeout[1]:.0f} s"
    elif isinstance(exc, exceptions.ProxyError):
        return TransientError(f"cannot reach registry {registry} through the proxy: "
                              f"{socket_why(text, timeout[1]) or 'the proxy failed'}",
                              "check HTTPS_PROXY / HTTP_PROXY and NO_PROXY")
    elif "Name or service not known" in text or "resolve" in text.lower():
        why = "unknown host"
    elif isinstance(exc, exceptions.ChunkedEncodingError):  # reached; its answer ended early
        return TransientError(f"registry {registry} cut its answer short (after "
                              f"{retries} tries)", CUT_SHORT_HINT)
    else:
        why = socket_why(text, timeout[1]) or type(exc).__name__
    return TransientError(f"cannot reach {what}: {why} (after {retries} tries)",
                          "check that the registry is up and the address is right")
