"""Run the benchmark suite and write ``report.md`` + ``report.json`` (BENCHMARKS.md).

    .venv/bin/python -m benchmarks [--quick] [--only NAME ...] [--out DIR]

Sections (each a module of this package with ``run(quick, workdir) -> report.Section``):
wire bytes, compression throughput, step time over a rate-limited link, memory, convergence
(the timed sections first, while nothing else runs; the convergence study last: its numbers do not
depend on the machine's load). ``benchmarks/gpu_check.sh`` is the separate one-shot check for a
machine with a GPU (docs/gpu_check.md).
``--quick`` runs every section at a smaller size (minutes, for a smoke test), not for numbers.
"""

import argparse
import importlib
import sys
import time
from pathlib import Path

from .report import Section, write

SECTIONS = ("wire_bytes", "throughput", "step_time", "memory", "convergence")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not numbers")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   metavar="NAME", help=f"sections to run, of {', '.join(SECTIONS)}")
    p.add_argument("--out", type=Path, default=None,
                   help="report folder (default: benchmarks/results, with --quick "
                        "benchmarks/results-quick, so a smoke test never replaces the committed run)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path("benchmarks/results-quick" if args.quick else "benchmarks/results")
    sections = []
    for name in args.only:
        mod = importlib.import_module(f"benchmarks.{name}")
        print(f"benchmarks: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        sec: Section = mod.run(quick=args.quick, workdir=args.out)
        sec.seconds = time.perf_counter() - t0
        sections.append(sec)
        print(f"benchmarks: {name} done in {sec.seconds:.0f} s"
              + (f" (skipped: {sec.skipped})" if sec.skipped else ""), file=sys.stderr, flush=True)
        if len(sections) < len(args.only):  # the sections so far, marked in progress
            write(sections, args.out, argv, pending=args.only[len(sections):])
    md = write(sections, args.out, argv)
    print(f"benchmarks: report in {md} and {md.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
