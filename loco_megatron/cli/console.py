"""One-line refusals on the command line: ``error: <message>`` and exit status 2."""

import os
import sys
import time

from ..config import LoCoConfigError

#: seconds a rank other than global rank 0 waits before printing its own error line
OTHER_RANKS_WAIT_S = 3.0


def fail(error: Exception) -> None:
    """Exit with status 2 and a one-line ``error: ...``.

    Every rank usually finds the same error: global rank 0 prints it at once; the others wait
    :data:`OTHER_RANKS_WAIT_S` seconds first (torchrun stops the remaining workers as soon as
    one exits non-zero, so rank 0's line comes first and theirs normally never appears), then
    print theirs with their rank, so an error found on one rank only is not lost.
    """
    _print_error(error)
    sys.exit(2)


def _print_error(error: Exception) -> None:
    """:func:`fail`'s line: global rank 0 at once, the others after :data:`OTHER_RANKS_WAIT_S`."""
    try:
        rank = int(os.environ.get("RANK") or 0)
    except ValueError:  # e.g. RANK=$SLURM_PROCID outside Slurm: print, as rank 0 would
        rank = 0
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(OTHER_RANKS_WAIT_S)
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)


def install_excepthook() -> None:
    """Make a :class:`~loco_megatron.config.LoCoConfigError` that escapes Megatron's own calls
    (raised while megatron-core builds ``DistributedDataParallel``: ranks that disagree on a
    bucket, a refused DDP setting) end the rank like :func:`fail`: one line, exit status 2,
    no traceback. Other exceptions go to the hook that was there before. Called once per
    launch-path process (:func:`loco_megatron.training.startup.prepare`); idempotent."""
    previous = sys.excepthook
    if getattr(previous, "loco_one_line", False):
        return

    def hook(etype, value, tb):
        if not isinstance(value, LoCoConfigError):
            return previous(etype, value, tb)
        _print_error(value)
        sys.stdout.flush()
        os._exit(2)  # no interpreter teardown: a rank whose peers died could block in it

    hook.loco_one_line = True
    sys.excepthook = hook


def cli_exit_code(action, argv=None, errors=(LoCoConfigError,)) -> int:
    """The launchers' one-line refusal, shared by the ``python -m`` checks: run
    ``action(argv)`` (``sys.argv[1:]`` when ``argv`` is None); on one of ``errors`` print
    ``error: <message>`` to stderr and return 2, else return 0."""
    try:
        action(sys.argv[1:] if argv is None else list(argv))
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
