"""``toy://`` URIs of the embedded worlds: ``toy://kimi`` (the mini-Kimi target dir) and ``toy://kimi/<path>``
(a path inside the mini-Kimi world: its hub-layout folders, its native SWE set); ``toy://long`` (the target of the
toy world's long-context variant, ``world.LONG_RECIPE``) and ``toy://long/<path>``; the rest by the toy world."""

from __future__ import annotations

import sys

from eagle_lib.toy import mini_kimi, world


def resolve(uri: str) -> str:
    """The local path of a toy:// URI, building its world if needed; any other string unchanged."""
    name = uri[len("toy://") :].strip("/") if uri.startswith("toy://") else ""
    if name == "long" or name.startswith("long/"):
        root = world.build(world.LONG_RECIPE, log=lambda *a: print(*a, file=sys.stderr, flush=True))
        rel = name[len("long/") :] if name.startswith("long/") else "target"
        if not (root / rel).exists():
            raise ValueError(f"unknown toy URI {uri!r}: the long-context toy world {root} has no {rel}")
        return str(root / rel)
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
    if name == "kimi" or name.startswith("kimi/"):
        root = mini_kimi.world_dir()
    elif name == "long" or name.startswith("long/"):
        root = world.world_dir(world.LONG_RECIPE)
    else:
        root = world.world_dir()
    return root.joinpath("build_log.json").is_file()
