"""LoCo figures in Megatron's training loop: iteration-line fields, TensorBoard scalars, timers.

The hook (megatron/training/training.py ``training_log``, Megatron-LM core_v0.13 to 0.19): the
training loop calls ``training_log`` once per iteration on every rank, after the optimizer step,
and on logging iterations it builds the iteration line and hands it to the module global
``print_rank_last`` (called on every rank; only the last rank prints). :func:`install` wraps
``training_log``:

* every call closes the step of :class:`~loco_megatron.metrics.StepMetrics`;
* while the original runs, ``print_rank_last`` is swapped for a function that, when given the
  iteration line, reduces the window's figures over all ranks (collective: all ranks are there),
  appends ``loco ...: value |`` fields, and writes ``loco/*`` scalars to the TensorBoard writer
  (last rank) and wandb when configured;
* with ``--timing-log-level 2`` the ``timers.log`` / ``timers.write`` calls of that
  ``training_log`` also get the ``loco-*`` timers (:data:`~loco_megatron.collectives.TIMER_NAMES`),
  so they print in Megatron's timer block (and go to TensorBoard with
  ``--log-timers-to-tensorboard``).

Definitions, groups and cost: docs/telemetry.md.
"""

import functools
import inspect
import os
import sys
from typing import Optional

from ..collectives import TIMER_NAMES
from ..drift_probe import DriftProbe
from ..weight_difference import TIMER_NAMES as PARAM_TIMER_NAMES
from ..metrics import LoCoFigures
from ..megatron import plugin
from ..patching import PatchSet

#: TensorBoard / wandb tag of each figure (LoCoFigures attribute -> tag)
TAGS = {
    "error_norm": "loco/compression-error-norm",
    "buffer_norm": "loco/error-buffer-norm",
    "bytes_per_step": "loco/wire-bytes-per-step",
    "compression_ratio": "loco/compression-ratio",
}

#: the patch set of :func:`install` (``training_log``) and the one of each iteration line
PATCH_SET, LINE_PATCH_SET = "loco-iteration-log", "loco-iteration-line"

_INSTALLED = None  # (PatchSet, LoCoState)


def megatron_timers():
    """megatron.training's global ``Timers``, or None when megatron.training is not imported or
    its globals are not set up (core-only use)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None or getattr(global_vars, "_GLOBAL_TIMERS", None) is None:
        return None
    return global_vars.get_timers()


def format_fields(fig: LoCoFigures) -> str:
    """The fields appended to Megatron's iteration line, in its `` name: value |`` style."""
    nbytes = fig.bytes_per_step
    nbytes = f"{int(nbytes)}" if nbytes == int(nbytes) else f"{nbytes:.1f}"
    return (f" loco compression error norm: {fig.error_norm:.6E} |"
            f" loco error buffer norm: {fig.buffer_norm:.6E} |"
            f" loco wire bytes per step: {nbytes} |"
            f" loco compression ratio: {fig.compression_ratio:.3f} |")


#: TensorBoard / wandb tag of each parameter all-gather figure (``--loco-param-bits``)
PARAM_TAGS = {
    "bytes_per_step": "loco/param-gather-bytes-per-step",
    "stock_bytes_per_step": "loco/param-gather-stock-bytes-per-step",
    "drift_max": "loco/param-drift-max",
    "drift_rms": "loco/param-drift-rms",
}


def format_param_fields(fig: dict) -> str:
    """The ``--loco-param-bits`` fields of the iteration line: the parameter all-gather's bytes
    per step (and stock's), and max / RMS of ``main - held`` relative to the parameters' RMS."""
    return (f" loco param-gather bytes per step: {fig['bytes_per_step']:.0f} "
            f"(stock {fig['stock_bytes_per_step']:.0f}) |"
            f" loco param drift max/rms: {fig['drift_max']:.3E}/{fig['drift_rms']:.3E} |")


def _write(values: dict, iteration: int) -> None:
    """``{tag: value}`` to TensorBoard (last rank) and wandb, at ``iteration``."""
    from megatron.training import global_vars

    writer = global_vars.get_tensorboard_writer()  # last rank only
    if writer is not None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, iteration)
    wandb_writer = global_vars.get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.log(values, iteration)


def _is_iteration_line(message) -> bool:
    return isinstance(message, str) and " iteration " in message and "|" in message


def _with_loco_timers(method, extra=TIMER_NAMES):
    @functools.wraps(method)
    def call(names, *args, **kwargs):
        return method(list(names) + [n for n in extra if n not in names], *args, **kwargs)
    return call


def _wrap_training_log(orig, module, state):
    signature = inspect.signature(orig)
    window = [0]  # training_log calls (optimizer steps) since the last iteration line

    @functools.wraps(orig)
    def training_log(*args, **kwargs):
        if plugin.get_state() is not state or (state.metrics is None
                                                and not state.param_active):
            return orig(*args, **kwargs)  # LoCo uninstalled since
        if state.metrics is not None:
            state.metrics.end_step()
        if state.active and state.compensator.probe is not None:
            state.compensator.probe.end_step()
        window[0] += 1
        iteration = signature.bind(*args, **kwargs).arguments["iteration"]
        print_line = module.print_rank_last

        def print_rank_last(message):
            if _is_iteration_line(message):
                # collectives: every rank prints through here
                fig = state.metrics.reduce() if state.metrics is not None else None
                if fig is not None:
                    message = message + format_fields(fig)
                    _write({tag: float(getattr(fig, name)) for name, tag in TAGS.items()},
                           iteration)
                if state.param_active:
                    pfig = state.param_sync.stats.reduce(window[0])
                    window[0] = 0
                    if pfig is not None:
                        message = message + format_param_fields(pfig)
                        _write({tag: float(pfig[name]) for name, tag in PARAM_TAGS.items()},
                               iteration)
            print_line(message)

        # for this call only: the iteration line and the timers' lists
        megatron_args = sys.modules["megatron.training.global_vars"].get_args()
        with PatchSet(LINE_PATCH_SET).applied() as patches:
            patches.replace(module, "print_rank_last", print_rank_last)
            timers = megatron_timers()
            if timers is not None and getattr(megatron_args, "timing_log_level", 0) >= 2:
                extra = (TIMER_NAMES if state.active else ()) + (
                    PARAM_TIMER_NAMES if state.param_active else ())
                for name in ("log", "write"):
                    patches.wrap(timers, name, functools.partial(_with_loco_timers, extra=extra))
            result = orig(*args, **kwargs)
        if state.param_active:  # the drift costs passes over the shard: only before a line
            interval = max(int(getattr(megatron_args, "log_interval", 1) or 1), 1)
            state.param_sync.stats.track_drift = (iteration + 1) % interval == 0
            state.param_sync.stats.drift = None
        return result
    return training_log


def install(state: Optional["plugin.LoCoState"] = None) -> bool:
    """Report LoCo figures and ``loco-*`` timers through Megatron's ``training_log``.

    Call after :func:`loco_megatron.install` and before ``megatron.training.pretrain``. Enables
    :meth:`~loco_megatron.megatron.plugin.LoCoState.enable_metrics` on ``state`` (default: the
    installed one) and points its timers at megatron.training's global timers.

    Returns:
        True when installed; False (nothing patched, nothing printed) when LoCo is off or not
        installed.

    Raises:
        RuntimeError: already installed (call :func:`uninstall` first).
        ImportError: ``megatron.training`` is not importable (megatron-core wheels < 0.17 need a
            Megatron-LM checkout on ``PYTHONPATH``).
    """
    global _INSTALLED
    if _INSTALLED is not None:
        raise RuntimeError("LoCo training telemetry is already installed; call uninstall() first")
    state = state if state is not None else plugin.get_state()
    if state is None or not (state.active or state.param_active):
        return False
    try:
        from megatron.training import training
    except ImportError as e:
        raise ImportError(
            "LoCo training telemetry needs megatron.training (megatron-core >= 0.17 wheels, or a "
            f"Megatron-LM checkout on PYTHONPATH): {e}") from e
    if state.active:
        state.enable_metrics()
        # the convergence study's instrument, off unless $LOCO_DRIFT_PROBE names a folder
        state.compensator.probe = DriftProbe.from_env(int(os.environ.get("RANK", "0")))
    state.timers = megatron_timers
    if state.param_active:
        state.param_sync.timers = megatron_timers
        state.param_sync.stats.track_drift = True
    patches = PatchSet(PATCH_SET)
    patches.wrap(training, "training_log", lambda orig: _wrap_training_log(orig, training, state))
    _INSTALLED = (patches, state)
    return True


def uninstall() -> None:
    """Restore Megatron's ``training_log`` and stop collecting metrics (no-op if not installed)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    patches, state = _INSTALLED
    patches.restore()  # PatchError when replaced again since: still installed
    state.metrics = state.timers = None
    if state.compensator is not None:
        state.compensator.metrics = state.compensator.probe = None
    _INSTALLED = None
