"""CLI: ``python -m eagle_lib.toy build [--world toy|kimi|long] [--force]`` builds the toy world (or the mini-Kimi
world, ``toy://kimi``, or the toy world's long-context variant, ``toy://long``) and prints its dir and build-log
summary;
``python -m eagle_lib.toy resolve URI`` prints the local path of a toy:// URI."""

from __future__ import annotations

import argparse
import json
import sys

from eagle_lib.toy import mini_kimi, uris, world


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m eagle_lib.toy", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse the cached) toy world")
    b.add_argument("--force", action="store_true", help="rebuild even if a cached world exists")
    b.add_argument(
        "--world", choices=["toy", "kimi", "long"], default="toy", help="which world (default: toy)"
    )
    r = sub.add_parser("resolve", help="print the local path of a toy:// URI")
    r.add_argument("uri")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
        mod = mini_kimi if args.world == "kimi" else world
        if args.world == "long":
            root = world.build(world.LONG_RECIPE, force=args.force, log=log)
        else:
            root = mod.build(force=args.force, log=log)
        print(root)
        print(mod.summary(json.loads((root / "build_log.json").read_text())))
        return 0
    try:
        print(uris.resolve(args.uri))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
