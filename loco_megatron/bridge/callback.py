"""LoCo's per-iteration figures in Megatron-Bridge's loggers: a Bridge ``Callback``.

Bridge fires ``on_train_step_end`` on every rank after each optimizer step
(megatron/bridge/training/train.py, before ``train_state.step`` is advanced and Bridge's own
``training_log`` runs for that iteration). :class:`LoCoCallback` closes LoCo's step there and,
every ``logger.log_interval`` iterations, reduces the window's figures over all ranks
(collective: every rank is there) and writes them, under the tags of the Megatron-LM path
(docs/telemetry.md), to ``state.tensorboard_logger`` and ``state.wandb_logger`` (last rank, as
Bridge's own scalars), at Bridge's iteration number:

* ``loco/compression-error-norm``, ``loco/error-buffer-norm``, ``loco/wire-bytes-per-step``,
  ``loco/compression-ratio`` (LoCo on, :class:`~loco_megatron.metrics.LoCoFigures`);
* ``loco/param-gather-bytes-per-step``, ``loco/param-gather-stock-bytes-per-step``,
  ``loco/param-drift-max``, ``loco/param-drift-rms`` (``loco.param_bits``).

``on_train_start`` prints LoCo's start-up line once per process (rank 0).
"""

from typing import List, Optional, Tuple

from megatron.bridge.training.callbacks import Callback

from ..megatron import plugin
from ..megatron.report import log_loco_startup
from ..training.iteration_log import PARAM_TAGS, TAGS


class LoCoCallback(Callback):
    """Writes LoCo's figures to Bridge's TensorBoard / W&B loggers (module docstring).

    Args:
        state: the :class:`~loco_megatron.megatron.plugin.LoCoState` to report (default: the
            one installed when training starts).
        emulated: for the start-up line (CPU ranks or GPU).

    Attributes:
        history: ``(iteration, {tag: value})`` of every window written, on every rank (tests,
            your own logging).
    """

    def __init__(self, state: Optional["plugin.LoCoState"] = None, emulated: bool = False):
        self.state, self.emulated = state, emulated
        self.history: List[Tuple[int, dict]] = []
        self._said = False
        self._window = 0

    def print_startup(self) -> None:
        """LoCo's start-up line (``> LoCo active: 4-bit ...``), once per callback."""
        state = self.state if self.state is not None else plugin.get_state()
        if self._said or state is None:
            return
        self._said = True
        log_loco_startup(state, None, self.emulated)

    def on_train_start(self, context) -> None:
        """Print the start-up line (once) and start collecting LoCo's figures."""
        if self.state is None:
            self.state = plugin.get_state()
        self.print_startup()
        state = self.state
        if state is not None and state.active:
            state.enable_metrics()
        if state is not None and state.param_active:
            state.param_sync.stats.track_drift = True

    def on_train_step_end(self, context) -> None:
        """Close LoCo's step; on Bridge's logging iterations reduce and write the figures."""
        state = self.state
        if state is None or plugin.get_state() is not state:
            return  # LoCo not installed, or uninstalled since
        if state.metrics is not None:
            state.metrics.end_step()
        self._window += 1
        iteration = context.state.train_state.step + 1  # what Bridge's training_log logs
        interval = max(int(getattr(context.state.cfg.logger, "log_interval", 1) or 1), 1)
        if state.param_active:  # the drift costs passes over the shard: only before a report
            state.param_sync.stats.track_drift = (iteration + 1) % interval == 0
        if iteration % interval:
            return
        values = {}
        fig = state.metrics.reduce() if state.metrics is not None else None  # collective
        if fig is not None:
            values.update({tag: float(getattr(fig, name)) for name, tag in TAGS.items()})
        if state.param_active:
            pfig = state.param_sync.stats.reduce(self._window)  # collective
            if pfig is not None:
                values.update({tag: float(pfig[name]) for name, tag in PARAM_TAGS.items()})
            state.param_sync.stats.drift = None
        self._window = 0
        if not values:
            return
        self.history.append((iteration, values))
        writer = context.state.tensorboard_logger
        if writer is not None:
            for tag, value in values.items():
                writer.add_scalar(tag, value, iteration)
        wandb_writer = context.state.wandb_logger
        if wandb_writer is not None:
            wandb_writer.log(values, iteration)

    def on_train_end(self, context) -> None:
        """Stop collecting LoCo's figures."""
        state = self.state
        if state is not None and state.compensator is not None:
            state.metrics = state.compensator.metrics = None
