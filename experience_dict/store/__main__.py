"""Command line: ``python -m experience_dict.store info|verify|stats URL [--keys K ...]``.

- ``info``: episodes per task / unit / success / demo flag / policy version, steps, bytes per shard (JSON).
- ``verify``: reads every chunk holding committed rows; reports crc32c failures and missing chunks with the
  episodes they hit (JSON); exit status 1 if anything is wrong.
- ``stats``: normalization statistics (min, max, mean, std, q01, q99 per dimension) per key (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys

from experience_dict.store.store import ExperienceStore


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 verify found problems)."""
    ap = argparse.ArgumentParser(prog="python -m experience_dict.store", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["info", "verify", "stats"])
    ap.add_argument("url", help="store URL (local directory or any fsspec URL)")
    ap.add_argument("--keys", nargs="*", default=None, help="stats: feature keys (default: all)")
    args = ap.parse_args(argv)
    store = ExperienceStore.open(args.url)
    if args.command == "info":
        out = store.info()
    elif args.command == "verify":
        out = store.verify()
    else:
        out = store.stats(args.keys) if len(store) else {}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0 if args.command != "verify" or out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
