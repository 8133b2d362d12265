"""Credentials out of text that leaves the process (errors, the journal, logs).

gpusnap never puts a password, token or key in a message on purpose; this is
the net under what it passes on from elsewhere (an argument a user typed as
`user:password@host/...`, a library's exception naming a URL or a header).
"""

from __future__ import annotations

import re

HIDDEN = "***"
# scheme://user:password@host and a reference typed as user:password@host/repo
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]+@")
_BARE_USERINFO = re.compile(r"(^|[\s'\"(=])[^/@\s'\"]+:[^/@\s'\"]*@(?=[A-Za-z0-9\[])")
# "Authorization: Basic xxx", "'Bearer xxx'", "token=xxx", "password": "xxx"
# (a token: 16 characters or more with a digit or a sign, so "Basic authentication" stays)
_SCHEME_CREDENTIAL = re.compile(r"\b(Basic|Bearer|basic|bearer)(\s+)"
                                r"(?=[A-Za-z0-9._~+/=-]*[0-9._~+/=-])[A-Za-z0-9._~+/=-]{16,}")
_NAMED_SECRET = re.compile(r"(?i)\b(password|passwd|passphrase|token|access_token|secret)"
                           r"([\"']?\s*[:=]\s*[\"']?)[^\s\"',;&}]+")


def has_userinfo(text: str) -> bool:
    """Does TEXT (a reference or URL) carry user[:password]@ before its host?"""
    return bool(_URL_USERINFO.search(text) or _BARE_USERINFO.search(text))


def redact(text: str) -> str:
    """TEXT with whatever looks like a credential replaced by ***."""
    text = _URL_USERINFO.sub(rf"\1{HIDDEN}@", text)
    text = _BARE_USERINFO.sub(rf"\1{HIDDEN}@", text)
    text = _SCHEME_CREDENTIAL.sub(rf"\1\2{HIDDEN}", text)
    return _NAMED_SECRET.sub(rf"\1\2{HIDDEN}", text)
