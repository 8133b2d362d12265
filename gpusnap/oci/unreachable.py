"""Why a registry cannot be reached, in words a user can act on.

requests wraps what the socket met (a down link, a blackholed route, a
registry that died mid-answer) in a ConnectionError whose class says
nothing; its text does.
"""

from __future__ import annotations

import re

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
