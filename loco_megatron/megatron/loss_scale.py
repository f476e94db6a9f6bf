"""LoCo under fp16 loss scaling: error buffers follow megatron-core's grad scaler.

With ``--fp16`` the loss, and so every gradient in the buckets, is multiplied by the loss scale
``S`` (``MegatronOptimizer.scale_loss``); LoCo's error buffers therefore hold errors in units of
``S * gradient``. megatron-core (megatron/core/optimizer/optimizer.py, 0.13-0.19,
``MixedPrecisionOptimizer.prepare_grads``) unscales the distributed optimizer's gradient shards,
all-reduces a ``found_inf`` flag over the optimizer's ``grad_stats_parallel_group`` (every rank of
the distributed-optimizer instance), calls ``grad_scaler.update(found_inf)``
(megatron/core/optimizer/grad_scaler.py) and skips the step when ``found_inf``;
``ChainedOptimizer.prepare_grads`` (dense + expert optimizers) runs this for each optimizer in
turn, each with its own scaler, and skips the whole step when any of them found an inf.

We wrap ``update`` of ``DynamicGradScaler`` and ``ConstantGradScaler``; after the original:

* ``found_inf`` (any scaler): every error buffer of the install is set to zero. The step's
  gradients are thrown away, so the errors computed from them (finite buckets updated their
  buffers before the inf was seen elsewhere) must not be fed back; the buckets that saw the
  non-finite values already cleared theirs in the compress kernel. *An overflow step clears all
  error buffers, as a reset.* All ranks see the same flag, so all ranks clear.
* otherwise, when the *loss scaler* replaced its scale tensor (megatron assigns a new tensor on
  growth and backoff, so a change is seen by identity without a host sync): every error buffer
  is multiplied by ``new / old`` on the device (:meth:`Compensator.rescale_errors`; exact for
  megatron's factors 2 and 0.5).

The loss scaler is the first scaler whose ``update`` runs under this install: the loss is scaled
by ``ChainedOptimizer.get_loss_scale()``, i.e. by ``chained_optimizers[0]``'s scaler, which
``ChainedOptimizer.prepare_grads`` also updates first. The other scalers of a chain never
rescale: they update identically (rescaling twice would square the factor) or, after an
expert-only overflow, diverge from the scale that really multiplied the gradients. If the loss
scaler is garbage-collected (a new optimizer under the same install), the next scaler updated
takes its place.

Step counters: an overflow step counts as a LoCo step (the compress calls ran), as
``megatron.training`` counts a skipped iteration in ``iteration`` (it only holds back the
learning-rate schedule), so resets and ``--loco-start-iter`` stay on megatron's iteration numbers
and a resumed run continues on the same schedule.

A loaded checkpoint changes the scale through ``load_state_dict``, not ``update``, together with
the error buffers saved in the same units: nothing is rescaled then.
"""

import functools
import weakref

import torch


class LossScaleTracker:
    """What the ``update`` hooks of one install did (``LoCoState.loss_scale``).

    Attributes:
        clears: ``update(found_inf=True)`` calls that cleared the error buffers (one per
            scaler, so a chain of two counts 2 per overflow step).
        rescales: loss-scale changes applied to the error buffers.
        scale: the loss scaler's scale tensor (``[1]`` fp32, on its device) the error buffers
            were last rescaled to, or None before the first change.
    """

    def __init__(self):
        self.clears = 0
        self.rescales = 0
        self.scale = None
        self._scaler = None  # weakref to the loss scaler

    def is_loss_scaler(self, scaler) -> bool:
        """True when ``scaler`` is the install's loss scaler (the first one updated; replaced
        when it no longer exists)."""
        current = self._scaler() if self._scaler is not None else None
        if current is None:
            self._scaler, current = weakref.ref(scaler), scaler
        return current is scaler

    def after_update(self, compensator, scaler, before: torch.Tensor, found_inf: bool) -> None:
        """Apply one ``scaler.update(found_inf)`` to ``compensator``'s error buffers.

        Args:
            compensator: the install's :class:`~loco_megatron.compensator.Compensator`.
            scaler: the megatron-core grad scaler just updated.
            before: its scale tensor before the update (``[1]`` fp32).
            found_inf: the flag megatron passed (already all-reduced across ranks).
        """
        loss_scaler = self.is_loss_scaler(scaler)
        if found_inf:
            compensator.clear_errors()
            self.clears += 1
            return
        after = scaler.scale
        if not loss_scaler or after is before:
            return
        compensator.rescale_errors(after.double() / before.double())
        self.rescales += 1
        self.scale = after


def _wrap_update(orig, state):
    @functools.wraps(orig)
    def update(self, found_inf):
        before = self.scale
        result = orig(self, found_inf)
        if state.active:
            state.loss_scale.after_update(state.compensator, self, before, bool(found_inf))
        return result
    return update


def patches(state):
    """``[(owner, attribute, wrapper factory)]`` that :func:`loco_megatron.install` applies when
    LoCo is active; the wrappers act on ``state`` (the install's ``LoCoState``).
    ``megatron.core.optimizer.grad_scaler`` has the same classes in 0.13-0.19."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    wrap = functools.partial(_wrap_update, state=state)
    return [(DynamicGradScaler, "update", wrap), (ConstantGradScaler, "update", wrap)]
