"""LoCo's start-up sequence around Megatron's training entry, shared by every way of launching.

Used by the main job (:mod:`loco_megatron.training.pretrain_gpt`), the wrapper around a user's Megatron-LM
checkout (:mod:`loco_megatron.training.run_megatron_lm`) and the patched ``pretrain_gpt.py`` of
``patches/``, so that they cannot drift apart:

1. :func:`prepare` - before Megatron starts: the ``--loco-*`` flags are checked (a bad value
   fails within a second), the CPU emulation is switched on when there is no GPU, and the
   workarounds of :mod:`.workarounds` are applied.
2. Megatron parses its arguments with :func:`extra_args_provider` chained into its own
   ``extra_args_provider`` (Megatron-LM megatron/training/arguments.py ``parse_args``).
3. :func:`install_from_args` - after Megatron has parsed and validated them, before the model
   and DDP are built: :func:`loco_config` builds the :class:`~loco_megatron.LoCoConfig`, the
   combination is checked, LoCo is installed and the start-up line is logged.

Every :class:`~loco_megatron.config.LoCoConfigError` ends the job with :func:`fail` (one line,
no traceback).
"""

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

from ..cli.console import fail
from ..megatron.report import print_rank_0 as _print_rank_0
from ..config import FULL_PRECISION_BITS, LoCoConfig, LoCoConfigError


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: adds LoCo's command-line options to ``parser``.

    The one place where LoCo options join Megatron's parser, in every launch path (``--loco-*``
    flags from :func:`loco_megatron.cli.flags.add_loco_args`). When the parser has
    them already (a script whose own provider adds them) it is a no-op, not an argparse
    conflict. Megatron help strings that break ``--help`` are escaped
    (:func:`.workarounds.escape_percent_in_help`).
    """
    from ..cli.flags import add_loco_args
    from .workarounds import escape_percent_in_help

    if "--loco-bits" not in getattr(parser, "_option_string_actions", {}):
        add_loco_args(parser)
    escape_percent_in_help(parser)
    return parser


def chain_args_providers(user_provider):
    """``extra_args_provider`` that applies ``user_provider`` (may be None) then LoCo's."""
    if user_provider is None:
        return extra_args_provider

    def provider(parser):
        result = user_provider(parser)
        return extra_args_provider(parser if result is None else result)

    return provider


def loco_config(args) -> LoCoConfig:
    """The :class:`LoCoConfig` of a parsed Megatron args namespace.

    The one place where LoCo settings are read back (flags; defaults for what is absent, e.g.
    after ``--yaml-cfg`` replaced the namespace).

    Raises:
        LoCoConfigError: invalid values, naming the flag.
    """
    from ..cli.flags import config_from_args

    return config_from_args(args)


_SAID = []

#: megatron's persistent checkpoint worker (dist_checkpointing/strategies/async_utils.py) is a
#: process of its own, outside the CUDA emulation: it calls torch.cuda.set_device(rank %
#: device_count()) there and dies (ZeroDivisionError), and the ranks then hang in the save
ASYNC_SAVE_ON_CPU = (
    "--async-save needs a GPU: on CPU ranks megatron's persistent checkpoint worker runs outside "
    "the CUDA emulation, dies, and leaves the ranks hanging in the save; drop --async-save "
    "(checkpoints are then written synchronously) or run on GPUs.")


def prepare(argv: Optional[Sequence[str]] = None, *, main_job: bool = False) -> bool:
    """Before Megatron starts: expand ``--config FILE`` (YAML, :mod:`.yaml_config`), check the
    ``--loco-*`` flags and the ``--data-path`` files, switch the CPU emulation on when there is no GPU, apply
    :mod:`.workarounds`.

    ``argv`` None (the launch paths) means Megatron's own ``sys.argv[1:]``, expanded in place so
    that Megatron's parser sees the file's flags before the command line's (CLI > YAML >
    defaults); an explicit ``argv`` is only checked. Without a GPU the launch paths also get
    the CPU-compatible Megatron settings the user did not set, said in one line
    (:mod:`.cpu_defaults`), and ``--distributed-backend nccl`` is refused.

    The ``megatron`` package that will run must already be importable (for a checkout: its
    directory first on ``sys.path``). Exits through :func:`fail` on a bad LoCo flag, and on
    ``--async-save`` without a GPU (:data:`ASYNC_SAVE_ON_CPU`, LoCo on or off).

    Returns:
        True when the CPU emulation is active (no GPU).
    """
    from ..data.check import DataPathError, check_data_args
    from ..cli.preflight import preparse_loco_config
    from ..cli.schedule import ScheduleError, check_lr_schedule
    from ..cli.yaml_config import expand_config_argv

    launching = argv is None
    try:
        if launching:
            sys.argv[1:] = expand_config_argv(sys.argv[1:])  # --config FILE: its flags, CLI after
            argv = sys.argv[1:]
        else:
            argv = expand_config_argv(list(argv))
        config = preparse_loco_config(argv)  # bad --loco-* values fail before Megatron starts
        check_lr_schedule(argv)  # a run shorter than its learning-rate warm-up
        check_data_args(argv)  # and missing or damaged --data-path files
    except (LoCoConfigError, DataPathError, ScheduleError) as e:
        fail(e)
    from ..cli.console import install_excepthook
    from ..emulation import activate_if_no_gpu
    from . import workarounds

    install_excepthook()  # LoCo's refusals from inside Megatron's calls: one line each

    emulated = activate_if_no_gpu()
    if emulated and "--async-save" in argv:
        fail(LoCoConfigError(ASYNC_SAVE_ON_CPU))
    if emulated:
        _cpu_settings(argv, launching)
    if not (main_job or emulated or config.bits is not None or config.param_bits is not None):
        return emulated  # LoCo off in the user's own script on a GPU: megatron as shipped
    applied = workarounds.apply_needed(emulated)
    if applied and not _SAID:  # once per process
        _SAID.append(True)
        _print_rank_0(f"> loco-megatron workarounds for megatron.training in this environment: "
                      f"{', '.join(applied)} (docs/compatibility.md)")
    return emulated


def _cpu_settings(argv, launching: bool) -> None:
    """On CPU ranks: refuse a GPU-only backend; in a launch path, add the CPU defaults the
    user did not set to ``sys.argv`` and say so (rank 0, one line)."""
    from .cpu_defaults import add_cpu_defaults, check_cpu_backend, startup_line

    try:
        check_cpu_backend(argv)
    except LoCoConfigError as e:
        fail(e)
    if launching:
        sys.argv[1:], added = add_cpu_defaults(sys.argv[1:])
        if added:
            _print_rank_0(startup_line(added))


def install_from_args(args, emulated: bool):
    """After Megatron parsed and validated ``args``, before the model/DDP is built: build and
    check the LoCo config, install LoCo, log the start-up line (rank 0).

    Exits through :func:`fail` on an invalid setting or combination.

    Without ``--loco-bits`` and ``--loco-param-bits`` (unset: LoCo off) nothing is installed:
    megatron-core runs as shipped, with no LoCo hook on DDP construction or checkpoints
    (``--loco-bits 16`` installs LoCo off, which checks that every DP rank agrees and warns about
    ignored LoCo state). Except when ``--load`` resumes a checkpoint holding LoCo state
    (:func:`~loco_megatron.megatron.checkpoint.hooks.checkpoint_holds_loco_state`): then LoCo is
    installed off, as with ``--loco-bits 16``, so that a checkpoint saved with
    ``--loco-param-bits`` loads with identical replicas (docs/param_gather.md).

    Returns:
        The :class:`~loco_megatron.megatron.plugin.LoCoState` of :func:`loco_megatron.install`,
        or None when nothing is installed.
    """
    from ..megatron.checkpoint.hooks import checkpoint_holds_loco_state
    from ..megatron.plugin import install
    from ..cli.preflight import check_megatron_args
    from ..megatron.report import log_loco_startup

    try:
        config = loco_config(args)
        check_megatron_args(args, config)
    except LoCoConfigError as e:
        fail(e)
    if config.bits is None and config.param_bits is None:
        if not checkpoint_holds_loco_state(getattr(args, "load", None),
                                           getattr(args, "ckpt_step", None),
                                           getattr(args, "non_persistent_global_ckpt_dir", None)):
            log_loco_startup(None, args, emulated)
            return None
        # a checkpoint saved with LoCo: installed off, so that its load keeps the replicas
        # identical (--loco-param-bits saves) and says what is ignored
        config = dataclasses.replace(config, bits=FULL_PRECISION_BITS[0])
        _print_rank_0(f"> LoCo: --load {args.load} holds LoCo state; LoCo is installed off "
                      f"(as --loco-bits {config.bits}) to load it")
    state = install(config)
    log_loco_startup(state, args, emulated)
    # Once per job, in every launch path: LoCo fields on the iteration line, TensorBoard, timers
    # (wraps the training loop's training_log of the megatron package that runs).
    from . import iteration_log

    iteration_log.install(state)
    return state
