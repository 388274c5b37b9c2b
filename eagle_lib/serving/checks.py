"""One check of a preflight (the offline one of `eagle_lib.serving.preflight` and the live one of
`eagle_lib.serving.live`) and the path comparison both make."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Check:
    name: str
    ok: bool
    message: str
    severity: str = "error"  # error | warning: a failed warning does not fail the preflight


def same_path(a: str, b: str) -> bool:
    """The same file or directory: equal strings, or both exist and resolve to one path."""
    if not a:
        return False
    pa, pb = Path(a), Path(b)
    return a == b or (pa.exists() and pb.exists() and pa.resolve() == pb.resolve())
