"""Batch webhooks: one JSON POST per attempt, signed when a secret is configured.

Delivery is at least once (a retry follows a timeout that may have reached the receiver), so
every request carries ``Idempotency-Key: <batch id>``. With a secret, ``X-Kvbatch-Signature``
is ``sha256=`` + the hex HMAC-SHA256 of the body under it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import urllib.error
import urllib.request
from typing import Any

MAX_BACKOFF_S = 3600.0


def post_event(url: str, event: dict[str, Any], secret: str | None, timeout_s: float) -> str | None:
    """POST ``event`` as JSON to ``url``; None on a 2xx answer, else why it failed."""
    if not url.startswith(("http://", "https://")):
        return f"unsupported webhook URL {url!r}: http(s) only"
    body = json.dumps(event, sort_keys=True).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "kvbatch-control",
        "X-Kvbatch-Event": str(event.get("type", "")),
        "Idempotency-Key": str(event.get("batch_id", "")),
    }
    if secret:
        digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        headers["X-Kvbatch-Signature"] = f"sha256={digest}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except Exception as exc:  # BadStatusLine, TLS errors...: an attempt all the same
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


def backoff_s(attempts: int, first_s: float) -> float:
    """Delay before attempt ``attempts + 1``: ``first_s`` doubling, capped at an hour."""
    return min(first_s * 2 ** max(attempts - 1, 0), MAX_BACKOFF_S)
