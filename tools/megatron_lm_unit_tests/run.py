"""Run Megatron-LM's own unit tests with loco_megatron installed; compare to stock.

    .venv/bin/python tools/megatron_lm_unit_tests/run.py --megatron-lm /path/to/Megatron-LM
    .venv/bin/python tools/megatron_lm_unit_tests/run.py --tag core_v0.19.0   # from a mirror
    .venv/bin/python tools/megatron_lm_unit_tests/run.py --tag core_v0.19.0 \
        --dir tests/unit_tests/dist_checkpointing

Each test file of ``--dir`` (the checkout's; default ``tests/unit_tests/distributed/``) runs under
``torchrun --nproc-per-node N -m pytest -p loco_mlm_plugin`` on CPU ranks (gloo, the CUDA
emulation; :mod:`loco_mlm_plugin`), once per mode: ``stock`` (loco_megatron not installed),
``bits16`` (installed, LoCo off) and ``bits4`` (installed, 4-bit LoCo), at 2 and 4 ranks. A test
passes when it passes on every rank. The table (``--table``, default
docs/megatron_lm_unit_tests.md for ``distributed/``, docs/megatron_lm_unit_tests_<dir>.md for
another directory; :mod:`mlm_table`) lists passed / failed / skipped per file and mode, files
skipped as a whole with their reason, and every test whose outcome or failure message
(normalised, :mod:`mlm_messages`) differs from stock, with the reason from
:data:`EXPECTED_BITS4` where LoCo on is expected to differ. Exit status 1 when bits 16 differs
from stock anywhere, or bits 4 differs outside :data:`EXPECTED_BITS4`.

Nothing of the checkout is copied into this repository; ``--tag`` extracts the tag from a git
mirror of NVIDIA/Megatron-LM (``LOCO_MEGATRON_LM_MIRROR``) into a temporary directory.
"""

import argparse
import fnmatch
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:  # mlm_messages, mlm_table (also when loaded from a file path)
    sys.path.insert(0, str(HERE))
from mlm_messages import differences
from mlm_table import DEFAULT_DIR, MODES, counts, default_table, table
#: a git mirror of NVIDIA/Megatron-LM the user named (``$LOCO_MEGATRON_LM_MIRROR``), or None
MIRROR = (Path(os.environ["LOCO_MEGATRON_LM_MIRROR"])
          if os.environ.get("LOCO_MEGATRON_LM_MIRROR") else None)

#: Where 4-bit LoCo is expected to change a Megatron-LM test's outcome, each with the reason:
#: ``("message", text)`` matches a failure whose message contains ``text`` (LoCo refusing a
#: configuration or a mock, by design), ``("test", pattern)`` a test id (fnmatch). Every other
#: difference from stock is unexpected.
EXPECTED_BITS4 = [
    (("message", "needs the distributed optimizer (--use-distributed-optimizer)"),
     "plain DDP (an all-reduce) over more than one rank: LoCo refuses it at DDP construction "
     "instead of leaving it uncompressed"),
    (("message", "param_and_grad_buffer.dist_reduce_scatter_func is"),
     "the test mocks dist_reduce_scatter_func, the very call LoCo replaces during "
     "start_grad_sync: refused, not bypassed"),
    (("message", "--ddp-reduce-scatter-with-fp32-accumulation"),
     "megatron's fp32-accumulation reduce-scatter and LoCo both replace the reduce-scatter: "
     "LoCo refuses the combination"),
    (("test", "*test_grad_sync_with_expert_parallel.py::test_grad_sync*"),
     "asserts exact gradient values after the reduce-scatter; LoCo sends 4-bit codes"),
    (("test", "*test_param_and_grad_buffer.py::test_grad_sync*"),
     "asserts exact gradient values after the reduce-scatter; LoCo sends 4-bit codes"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_path(args, tmp: Path) -> Path:
    """The checkout to test: ``--tag`` (extracted from the mirror) wins over ``--megatron-lm``,
    which defaults to ``$MEGATRON_LM``. Exits with one line when neither works."""
    if args.tag:
        if MIRROR is None or not MIRROR.is_dir():
            where = f" ({MIRROR} is not a directory)" if MIRROR is not None else ""
            sys.exit(f"error: --tag needs LOCO_MEGATRON_LM_MIRROR set to a git mirror of "
                     f"NVIDIA/Megatron-LM{where}, or pass --megatron-lm PATH")
        path = tmp / args.tag
        path.mkdir(parents=True)
        archive = subprocess.run(["git", f"--git-dir={MIRROR}", "archive", args.tag, "tests",
                                  "megatron"], capture_output=True)
        if archive.returncode != 0:
            why = " ".join(archive.stderr.decode(errors="replace").strip().splitlines()[-1:])
            sys.exit(f"error: --tag {args.tag}: not in the mirror {MIRROR} ({why}); tags look "
                     f"like core_v0.19.0")
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive.stdout, check=True)
    elif args.megatron_lm:
        path = Path(args.megatron_lm)
    else:
        sys.exit("error: pass --megatron-lm PATH (or set MEGATRON_LM) or --tag core_v0.19.0")
    test_dir = getattr(args, "dir", DEFAULT_DIR)
    if not (path / test_dir).is_dir():
        sys.exit(f"error: --megatron-lm {path}: no {test_dir}/ (not a Megatron-LM checkout, or "
                 f"--dir is not a directory of it?)")
    return path


def run_file(checkout: Path, test: str, mode: str, ranks: int, timeout: int, log) -> dict:
    """``{test id: {"outcome": ..., "message": ...}}`` of one file, merged over the ranks."""
    with tempfile.TemporaryDirectory() as out:
        # PYTHONHASHSEED: the same set and dict orders in every mode (messages are compared)
        env = dict(os.environ, LOCO_MLM_BITS=mode.replace("bits", ""), LOCO_MLM_OUT=out,
                   OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONHASHSEED="0",
                   PYTHONPATH=os.pathsep.join([str(checkout), str(HERE), str(ROOT)]))
        env.pop("MEGATRON_LM", None)
        # the checkout's own megatron package is first on sys.path: it is what runs and what
        # loco_megatron patches (its tests match its code)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(_free_port()), "-m", "pytest", "-q", "-p", "loco_mlm_plugin",
               "-p", "no:cacheprovider", "-o", "addopts=", test]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            rc = proc.returncode
            crashed = rc not in (0, 1, 5)
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            rc, crashed, tail = None, True, f"timed out after {timeout} s"
        log.write(f"=== {test} {mode} ranks={ranks} ({time.monotonic() - start:.0f} s)\n"
                  f"{tail}\n")
        per_rank = []
        for r in range(ranks):
            path = Path(out) / f"rank{r}.json"
            per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    if rc not in (0, 5) and not any(per_rank):  # pytest failed before any test (a file it
        crashed = True                           # could not find): never reads as 0 / 0 / 0
    merged = merge_ranks(per_rank, test, crashed)
    for test_id, res in sorted(merged.items()):  # the reasons, also of stock's own failures
        if res["outcome"] == "failed" or test_id.endswith(">"):  # and whole-file skips
            log.write(f"{res['outcome'].upper()} {test_id} [{mode}, {ranks} ranks]: "
                      f"{res.get('message', '')}\n")
    return merged


def merge_ranks(per_rank, test: str, crashed: bool) -> dict:
    """One outcome per test from every rank's: failed if it failed on any rank, passed if it
    passed on one and failed on none, else skipped; a crashed or timed-out run adds a failed
    ``<file>`` entry (what it did not report cannot count as passed)."""
    merged = {}
    for rank_results in per_rank:
        for test_id, res in rank_results.items():
            old = merged.get(test_id)
            if old is None or res["outcome"] == "failed" or (
                    res["outcome"] == "passed" and old["outcome"] == "skipped"):
                merged[test_id] = res
    if crashed:  # a rank died or hung: everything it did not report counts as failed
        merged.setdefault(f"{test}::<file>", {"outcome": "failed",
                                              "message": "ranks crashed or timed out"})
    return merged


def expected_reason(test_id: str, message: str):
    """The reason from :data:`EXPECTED_BITS4` for a bits-4 outcome that differs, or None."""
    for (kind, match), reason in EXPECTED_BITS4:
        if (kind == "message" and match in message) or (
                kind == "test" and fnmatch.fnmatchcase(test_id, match)):
            return reason
    return None


def compare(res: dict, modes, ranks: int) -> list:
    """Every result of ``res`` (``{mode: results}``) that differs from stock's, outcome or
    normalised message: ``(mode, ranks, test id, stock outcome, outcome, message, reason,
    stock message)``; ``reason`` from :data:`EXPECTED_BITS4` (bits 4 only), else None."""
    diffs = []
    for mode in modes:
        if mode == "stock":
            continue
        for test_id, a, b, stock_message, message in differences(res["stock"], res[mode]):
            reason = expected_reason(test_id, message) if mode == "bits4" else None
            diffs.append((mode, ranks, test_id, a, b, message, reason, stock_message))
    return diffs


def write_table(args, name, files, rows, diffs, elapsed, partial=False) -> None:
    """(Re)write ``args.table`` from the rows so far, sorted by file and rank count."""
    rows = sorted(rows, key=lambda row: (row[0], row[1]))
    diffs = sorted(diffs, key=lambda d: (d[0], d[1], d[2]))
    text = table(name, rows, diffs, elapsed,
                 os.path.relpath(ROOT / "docs" / "megatron_lm_unit_tests_harness.md",
                                 Path(args.table).resolve().parent),
                 None if args.files is None else len(files),
                 args.dir if args.files is None else None)
    if partial:
        text = text.replace("\n\n", f"\n\n**Partial run**: {len(rows)} of "
                            f"{len(files) * len(args.ranks)} file and rank-count runs so far.\n\n", 1)
    Path(args.table).write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                        help="a Megatron-LM checkout (default: $MEGATRON_LM)")
    parser.add_argument("--tag", help="extract this tag from the mirror (LOCO_MEGATRON_LM_MIRROR); "
                        "wins over --megatron-lm")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="ranks per run (torchrun --nproc-per-node), each in turn")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="stock is always the reference")
    parser.add_argument("--dir", default=DEFAULT_DIR, help="the test directory (relative to the "
                        f"checkout; default {DEFAULT_DIR}); its table: "
                        "docs/megatron_lm_unit_tests_<dir>.md")
    parser.add_argument("--files", nargs="+", help="test files (relative to the checkout); "
                        "default: every test_*.py under --dir")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per file and mode "
                        "(each test: LOCO_MLM_TEST_TIMEOUT, default 120)")
    parser.add_argument("--table", default=None, help="where the markdown table goes "
                        "(default: the directory's committed table; required with --files)")
    parser.add_argument("--log", default=None, help="every failure's message and the runs' "
                        "output tails (default: beside the table, .log)")
    args = parser.parse_args(argv)
    if "stock" not in args.modes:
        parser.error("--modes must include stock (the reference)")
    args.modes = ["stock"] + [m for m in dict.fromkeys(args.modes) if m != "stock"]
    args.dir = args.dir.strip("/")
    if args.files and args.table is None:
        parser.error(f"--files needs --table PATH: a partial run would replace the committed "
                     f"table {default_table(args.dir)}")
    args.table = args.table or str(ROOT / default_table(args.dir))
    if not Path(args.table).resolve().parent.is_dir():
        parser.error(f"--table {args.table}: its directory does not exist")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = checkout_path(args, Path(tmp))
        missing = [f for f in args.files or () if not (checkout / f).is_file()]
        if missing:
            sys.exit(f"error: --files {' '.join(missing)}: not in the checkout {checkout} "
                     f"(paths are relative to it, e.g. "
                     f"tests/unit_tests/distributed/test_param_and_grad_buffer.py)")
        files = args.files or sorted(str(p.relative_to(checkout)) for p in
                                     (checkout / args.dir).rglob("test_*.py"))
        rows, diffs = [], []
        log_path = args.log or str(Path(args.table).with_suffix(".log"))
        name = args.tag or Path(checkout).name
        with open(log_path, "w") as log:
            # every file at the first rank count, then at the next: a run stopped early (time)
            # has whole rank counts; the table is rewritten after each file, marked partial
            for ranks in args.ranks:
                for test in files:
                    res = {m: run_file(checkout, test, m, ranks, args.timeout, log)
                           for m in args.modes}
                    rows.append((test, ranks, res))
                    diffs += compare(res, args.modes, ranks)
                    print(f"{test} ranks={ranks}: " + ", ".join(
                        f"{m} {counts(res[m])}" for m in args.modes), flush=True)
                    write_table(args, name, files, rows, diffs, time.monotonic() - start,
                                partial=len(rows) < len(files) * len(args.ranks))
    print(f"table written to {args.table}")
    bad = [d for d in diffs if d[0] == "bits16" or d[6] is None]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
