"""Secrets never reach a file or a tracking server: credentials in a URI's user part
(``http://user:password@host``) and token-like query values (``?token=...``) are replaced by
``***`` in everything glassloop records or sends (config.json, run.json and its command line,
checkpoint metadata, the report, tracking parameters). The tracker itself still connects with
the URI as given; put credentials in environment variables (``MLFLOW_TRACKING_USERNAME``,
``MLFLOW_TRACKING_PASSWORD``, ``WANDB_API_KEY``) to resume a run from its own config.json.
"""

from __future__ import annotations

import re
from typing import Any

SECRET = "***"
USER_PART = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s?#]+@")
TOKEN_QUERY = re.compile(
    r"([?&;][^=&;#\s]*(?:token|key|secret|passw(?:or)?d|pwd|auth|sig(?:nature)?|credential)"
    r"[^=&;#\s]*=)[^&;#\s]*",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with every URI's user part and token-like query values replaced.

    >>> redact("tracking.uri=http://ann:s3cret@host:5000/?api_key=abc&x=1")
    'tracking.uri=http://***@host:5000/?api_key=***&x=1'
    """
    return TOKEN_QUERY.sub(rf"\g<1>{SECRET}", USER_PART.sub(rf"\g<1>{SECRET}@", text))


def redacted(value: Any) -> Any:
    """``value`` (a config, a command line: nested dicts, lists and strings) with every
    string :func:`redact`-ed; other values as they are."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redacted(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(item) for item in value)
    return value
