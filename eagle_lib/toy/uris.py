"""``toy://`` URIs of both embedded worlds: ``toy://kimi`` (the mini-Kimi target dir) and ``toy://kimi/<path>``
(a path inside the mini-Kimi world: its hub-layout folders, its native SWE set), the rest by the toy world."""

from __future__ import annotations

import sys

from eagle_lib.toy import mini_kimi, world


def resolve(uri: str) -> str:
    """The local path of a toy:// URI, building its world if needed; any other string unchanged."""
    name = uri[len("toy://") :].strip("/") if uri.startswith("toy://") else ""
    if name != "kimi" and not name.startswith("kimi/"):
        return world.resolve(uri)
    root = mini_kimi.build(log=lambda *a: print(*a, file=sys.stderr, flush=True))
    rel = name[len("kimi/") :] if name.startswith("kimi/") else "target"
    if not (root / rel).exists():
        raise ValueError(f"unknown toy URI {uri!r}: the mini-Kimi world {root} has no {rel}")
    return str(root / rel)


def built(uri: str) -> bool:
    """Whether the world a toy:// URI lives in is built (resolving it would not start a build)."""
    name = uri[len("toy://") :].strip("/")
    kimi = name == "kimi" or name.startswith("kimi/")
    return (mini_kimi.world_dir() if kimi else world.world_dir()).joinpath("build_log.json").is_file()
