"""What a caller sent, quoted back in an error, is cut: a 100,000-character model name becomes
a message of a few hundred characters, wherever the message is shown or stored (batch errors,
job errors, HTTP answers)."""

from __future__ import annotations

from collections.abc import Iterable

MAX_ECHO_CHARS = 100  # of one quoted value
MAX_MESSAGE_CHARS = 500  # of a whole error message
ELLIPSIS = "…"


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis at the end when longer."""
    return text if len(text) <= limit else text[:limit - len(ELLIPSIS)] + ELLIPSIS


def quote(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``value`` as an error quotes it (``repr``), at most ``limit`` characters: a long one is
    cut, an ellipsis before its closing quote (``'aaaa…'``)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[:limit - len(ELLIPSIS) - 1] + ELLIPSIS + text[-1]


def quote_all(values: Iterable[object], most: int = 5) -> str:
    """The first ``most`` of ``values``, each as :func:`quote` gives it, joined by commas;
    ``and <n> more`` for the rest."""
    items = list(values)
    shown = ", ".join(quote(v) for v in items[:most])
    return shown if len(items) <= most else f"{shown} and {len(items) - most} more"
