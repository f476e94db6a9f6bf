"""Check the learning-rate schedule flags before ranks start.

Megatron-LM asserts ``lr_warmup_steps < lr_decay_steps`` only once every rank is up
(``megatron/core/optimizer_param_scheduler.py``; ``--lr-decay-iters`` defaults to
``--train-iters``), as a bare ``AssertionError`` on every rank. ``run_pretrain.sh`` sets
``--lr-warmup-iters 20``, so shortening a run with ``--train-iters 10`` alone hits it.
:func:`check_lr_schedule` says so in one line first: ``run_pretrain.sh`` runs
``python -m loco_megatron.cli.schedule`` on its defaults plus your flags before launching
(no torch import: well under a second), and :func:`loco_megatron.training.startup.prepare`
calls it in every launch path.
"""

import argparse
import sys
from typing import Iterable


class ScheduleError(ValueError):
    """Learning-rate schedule flags Megatron would refuse; the message names them."""


def check_lr_schedule(argv: Iterable[str]) -> None:
    """Raise :class:`ScheduleError` when the warm-up does not end before the decay does
    (the last value of each flag counts, as with argparse; ``--lr-warmup-fraction`` and
    sample-based schedules are left to Megatron)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--train-iters", "--lr-warmup-iters", "--lr-decay-iters"):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--lr-warmup-fraction", type=float, default=None)
    try:
        args, _ = parser.parse_known_args(list(argv))
    except SystemExit:  # a malformed value: Megatron's own parser reports it
        return
    if args.lr_warmup_fraction is not None or not args.lr_warmup_iters:
        return
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if decay is not None and args.lr_warmup_iters >= decay:
        what = (f"--lr-decay-iters {decay}" if args.lr_decay_iters is not None
                else f"--train-iters {decay} (the default --lr-decay-iters)")
        raise ScheduleError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be below {what}: Megatron ends the "
            f"learning-rate warm-up before the decay (run_pretrain.sh's default warm-up is 20 "
            f"iterations). For a short run pass e.g. --lr-warmup-iters "
            f"{max(0, decay // 10)} as well.")


def main(argv=None) -> int:
    """``python -m loco_megatron.cli.schedule ARGS``: print ``error: ...`` and return 2
    when :func:`check_lr_schedule` refuses ``ARGS``, else return 0 silently."""
    from .console import cli_exit_code

    return cli_exit_code(check_lr_schedule, argv, (ScheduleError,))


if __name__ == "__main__":
    sys.exit(main())
