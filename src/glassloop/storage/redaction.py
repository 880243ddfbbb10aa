"""Secrets never reach a file, the console or a tracking server: :func:`redact` is the one
redaction every string glassloop records, sends or prints about a URI goes through
(config.json, run.json and its command line, checkpoint metadata, the report, tracking
parameters, the tracker's warning and what the tracking library prints while glassloop
calls it).

What it replaces by ``***``, in every form a URI is written:

* the user part (``http://user:password@host``, ``http://token@host``), with or without a
  scheme (``user:password@host:5000``, ``token@host:5000``, ``token@host/path``; after
  ``uri=`` or ``url=``, or for a config key that names a URI, any ``token@host``);
* token-like values in the query and the fragment (``?api_key=...``, ``&sig=...``,
  ``#access_token=...``);
* the same, percent-encoded (``pass%77ord=...``, ``%3Ftoken%3D...``, ``user%3Apw%40host``):
  when a secret shows only once decoded, the decoded text is what is kept, redacted.

* every secret a URI glassloop was given holds (:func:`remember_secrets`: a run directory's
  or a tracking server's user part, password or token), wherever it shows, in whatever
  shape: a driver's own message quotes what it was handed (botocore's ``Invalid bucket
  name "TOKEN@bucket"``), which no pattern can tell from an e-mail address.

What it keeps: ``host:5000``, ``sqlite:///mlflow.db``, ``git@github.com:org/repo``, and an
e-mail address that is not in a URI (``ann@example.com`` as a tag or in a message: an address
is not a credential, and a reader needs it). A raw ``/`` in a password ends the user part
(as for every URI parser): write it ``%2F``.

The tracker itself still connects with the URI as given; put credentials in environment
variables (``MLFLOW_TRACKING_USERNAME``, ``MLFLOW_TRACKING_PASSWORD``, ``WANDB_API_KEY``) to
resume a run from its own config.json.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

SECRET = "***"
# Where a URI written without a scheme can begin: the start, a space, a quote, a bracket,
# `=`, `,` or `;` (a user part glued to other text, as in `see:x@y`, is left alone).
_START = r"(?:^|(?<=[\s\"'(\[{<=,;]))"
# A host: a name or an IPv4/IPv6 address.
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
# A user part runs to the last `@` before the path (as urlsplit reads it): a password may
# hold a raw `@`, `:`, `?`, `#` or `'`; `"` and `<>` (never in a URI) end it.
_USER = r"[^\s/\"<>]*@"
# (`:/+`: a URI that went through a path, which merges `//`, keeps its scheme)
WITH_SCHEME = re.compile(rf"(\b[A-Za-z][A-Za-z0-9+.-]*:/+){_USER}")
# `user:password@host` without a scheme (a name, a colon, then anything up to the `@`).
NO_SCHEME_PASSWORD = re.compile(rf"{_START}[^\s/@:\"'<>=]+:{_USER}(?={_HOST})")
# `token@host:5000` or `token@host/path` without a scheme: a port or a path tells it from an
# e-mail address.
NO_SCHEME_TOKEN = re.compile(rf"{_START}[^\s/@:\"'<>=]+@(?={_HOST}(?::\d+|/))")
# After `uri=`, `url: ` or `uri '` (a key that names a URI), any `token@host` is a user part.
AFTER_URI_KEY = re.compile(
    rf"((?<![A-Za-z])ur[il]\"?\s*[=:\s]\s*[\"']?)(?![A-Za-z][A-Za-z0-9+.-]*://){_USER}",
    re.IGNORECASE,
)
TOKEN_VALUE = re.compile(
    r"([?&;#][^=&;#\s\"'<>]*"
    r"(?:token|key|secret|passw(?:or)?d|pwd|auth|sig(?:nature)?|credential|session|jwt|bearer)"
    r"[^=&;#\s\"'<>]*=)[^&;#\s\"'<>]*",
    re.IGNORECASE,
)
URI_KEY = re.compile(r"(?<![A-Za-z])ur[il]$", re.IGNORECASE)  # uri, url, base_url, tracking_uri
# The secrets of the URIs this process was given (remember_secrets), longest first: each is
# replaced wherever it shows. A secret shorter than this is left to the patterns (replacing
# every "ab" in a message would make it unreadable, and hides nothing worth hiding).
_KNOWN: list[str] = []
MIN_SECRET = 4


def remember_secrets(uri: str) -> None:
    """Remember the secrets ``uri`` holds (its user part, the password or token in it, and
    token-like query and fragment values, as written and percent-decoded): every later
    :func:`redact` in this process replaces each of them wherever it shows.

    >>> remember_secrets("s3://T0KEN-42@bucket/run"); remember_secrets("s3://b/run#Bare-7oken")
    >>> redact('Invalid bucket name "T0KEN-42@bucket"'), redact("s3://b/run#Bare-7oken")
    ('Invalid bucket name "***@bucket"', 's3://b/run#***')
    """
    try:
        parts = urlsplit(uri if "://" in uri else f"//{uri}")
    except ValueError:  # (an invalid IPv6 host: nothing parsed, the patterns still apply)
        return
    found: list[str] = []
    user, at, _ = parts.netloc.rpartition("@")
    if at:
        _, colon, password = user.partition(":")
        found += [user, password] if colon else [user]
    for text in (parts.query, parts.fragment):
        found += [value for key, value in parse_qsl(text) if TOKEN_VALUE.search(f"?{key}=")]
        if text and "=" not in text:  # a bare value (`#Tok3n`, `?Tok3n`): a token, whole
            found.append(text)
    for secret in found:
        for form in {secret, unquote(secret)}:
            if len(form) >= MIN_SECRET and form not in _KNOWN:
                _KNOWN.append(form)
    _KNOWN.sort(key=len, reverse=True)


def remember_secrets_in(text: str) -> None:
    """:func:`remember_secrets` of every URI with a scheme in ``text`` (a command-line
    argument: ``--run-dir=s3://...``, ``tracking.uri=http://...``)."""
    for uri in re.findall(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+", text):
        remember_secrets(uri)


def redact(text: str, *, uri: bool = False) -> str:
    """``text`` with every URI's user part and token-like query and fragment values replaced
    by ``***`` (``uri=True``: ``text`` is a URI, so a ``token@host`` at its start is a user part
    even without a scheme or a port).

    >>> redact("tracking.uri=http://ann:s3cret@host:5000/?api_key=abc&x=1")
    'tracking.uri=http://***@host:5000/?api_key=***&x=1'
    >>> redact("user:pw@host:5000"), redact("token@host:5000"), redact("token@host", uri=True)
    ('***@host:5000', '***@host:5000', '***@host')
    >>> redact("http://host/#access_token=abc&x=1"), redact("http://h/?pass%77ord=pw")
    ('http://host/#access_token=***&x=1', 'http://h/?password=***')
    >>> redact("host:5000 sqlite:///mlflow.db ann@example.com git@github.com:org/repo")
    'host:5000 sqlite:///mlflow.db ann@example.com git@github.com:org/repo'
    """
    for secret in _KNOWN:  # (a remembered secret, whatever surrounds it)
        text = text.replace(secret, SECRET)
    cleaned = decoded = _redact_plain(text, uri=uri)
    # A secret that shows only percent-decoded (`pass%77ord=`, `%3Ftoken%3D`, a URI inside a
    # query value, `%2540`: encoded twice): keep the decoded text, redacted.
    while (once := unquote(decoded)) != decoded:
        decoded = once
        if _redact_plain(decoded, uri=uri) != decoded:
            return redact(decoded, uri=uri)
    return cleaned


def _redact_plain(text: str, *, uri: bool) -> str:
    if uri and "://" not in text:
        text = re.sub(rf"^\s*{_USER}", f"{SECRET}@", text)
    text = WITH_SCHEME.sub(rf"\g<1>{SECRET}@", text)
    text = AFTER_URI_KEY.sub(rf"\g<1>{SECRET}@", text)
    text = NO_SCHEME_PASSWORD.sub(f"{SECRET}@", text)
    text = NO_SCHEME_TOKEN.sub(f"{SECRET}@", text)
    return TOKEN_VALUE.sub(rf"\g<1>{SECRET}", text)


def redacted(value: Any, *, uri: bool = False) -> Any:
    """``value`` (a config, a command line: nested dicts, lists and strings) with every
    string :func:`redact`-ed, a key's too; a value under a key that names a URI (``uri``,
    ``url``, ``base_url``) is read as a URI; other values as they are.

    >>> redacted({"tracking": {"uri": "token@host", "tags": {"owner": "ann@example.com"}}})
    {'tracking': {'uri': '***@host', 'tags': {'owner': 'ann@example.com'}}}
    """
    if isinstance(value, str):
        return redact(value, uri=uri)
    if isinstance(value, dict):
        return {
            redacted(key): redacted(item, uri=isinstance(key, str) and bool(URI_KEY.search(key)))
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(item, uri=uri) for item in value)
    return value


def printable(value: Any, limit: int = 200) -> str:
    """``value`` as glassloop prints a field it read from a file anyone could have written (a
    lease in a bucket, a manifest, run.json): each control character (a newline that would
    start a forged line of glassloop's, a terminal's escape sequence) and other unprintable
    one shown as ``?``, cut to ``limit`` characters.

    >>> printable("node-7\\nglassloop: error: forged \\x1b[2J")
    'node-7?glassloop: error: forged ?[2J'
    """
    text = "".join(c if c.isprintable() else "?" for c in str(value)[: limit + 1])
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """What is printed to stdout and stderr inside the block (a tracking library's own lines:
    MLflow's "View run at <the tracking URI>"), :func:`redact`-ed and written when the block
    ends.

    >>> with redacted_output():
    ...     print("View run at: http://ann:s3cret@host:5000/#/experiments/1")
    View run at: http://***@host:5000/#/experiments/1
    """
    stdout, stderr = sys.stdout, sys.stderr
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        for stream, text in ((stdout, out.getvalue()), (stderr, err.getvalue())):
            if text:
                stream.write(redact(text))
                stream.flush()
