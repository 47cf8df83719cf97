"""Names every merge module shares: the merge spaces and the one "did you mean" helper. A leaf (standard
library only), so the recipe graph, the registry and the block maps use them without importing each other.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

WEIGHT, DELTA, PARAM, ANY = "weight", "delta", "param", "any"
SPACES = (WEIGHT, DELTA, PARAM, ANY)


def nearest(name: str, choices: Iterable[str], cutoff: float = 0.6) -> list[str]:
    """Up to three of ``choices`` close to a misspelt ``name``, closest first."""
    return difflib.get_close_matches(name, list(choices), n=3, cutoff=cutoff)


def suggestion(close: Sequence[str]) -> str:
    """``did you mean 'a' or 'b'?`` for the names in ``close``; empty when there are none."""
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'a'?)`` to append to a message about ``name``; empty when nothing is close."""
    close = nearest(name, choices)
    return f" ({suggestion(close)})" if close else ""
