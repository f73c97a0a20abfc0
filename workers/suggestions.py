"""Close-name hints for errors about a name the user typed (an architecture, a class)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def did_you_mean(name: str, candidates: Sequence[str]) -> str:
    """A ' (did you mean ...?)' hint listing up to three close matches of ``name``, or ''.

    Matches are looked for as typed first, then ignoring case (``resnetforimageclassification``
    still finds ``ResNetForImageClassification``), so a typo costs the user one retry.
    """
    matches = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if not matches:
        lowered = {c.lower(): c for c in candidates}
        matches = [lowered[m] for m in difflib.get_close_matches(name.lower(), list(lowered), n=3)]
    return f" (did you mean {', '.join(matches)}?)" if matches else ""
