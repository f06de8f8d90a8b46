"""`python -m psrt.trace FILE [--png OUT]`: what a psrt timeline holds, per rank and phase,
and the timeline drawn as a PNG (ranks as rows, one lane per thread, colours by category).

    ./mpi_launch -np 4 python -m psrt.train --dp ring --steps 5 --trace out/ring.json
    python -m psrt.trace out/ring.json --png out/ring.png
"""
from __future__ import annotations

import argparse
import sys

from psrt.errors import ArgumentParser, cli_main
from psrt.trace.view import draw, load, totals


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m psrt.trace", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a trace written by --trace")
    ap.add_argument("--png", help="draw the timeline into this PNG")
    return ap


@cli_main("psrt.trace")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    events = load(args.file)
    rows = totals(events)
    width = max([len(r["name"]) for r in rows] + [4])
    print(f"rank  {'span':<{width}}  category  count  total ms")
    for r in rows:
        print(f"{r['rank']:>4}  {r['name']:<{width}}  {r['cat']:<8}  {r['count']:>5}  {r['ms']:>8.1f}")
    if args.png:
        draw(events, args.png)
        print(f"psrt.trace: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
