"""The CPU environment's gaps in megatron-core's optimizer, shimmed (part of :mod:`loco_mlm_plugin`).

Without Transformer Engine and apex, ``megatron.core.optimizer`` falls back to torch's Adam /
AdamW (``USING_PYTORCH_OPTIMIZER``; ``HAVE_APEX_OR_TE = False`` in ``distrib_optimizer.py``).
Megatron-LM's tests are written for TE's / apex's ``FusedAdam``, and two of the differences
stop them before anything they test runs. Each shim below makes torch's Adam behave as
FusedAdam does in exactly that respect and nothing else; :data:`SHIMS` lists them with their
reasons. They are applied in every mode alike (stock, bits 16, bits 4): they change what the
tests can reach, never how a mode compares with stock.
"""

import functools
import inspect

#: shim -> reason (also in docs/megatron_lm_unit_tests_harness.md)
SHIMS = {
    "torch.optim.Adam(lr=None)": (
        "megatron-core builds the optimizer with lr=config.lr, None unless a test sets it "
        "(megatron sets the learning rate from its scheduler before every step). FusedAdam "
        "stores None as it is; torch's Adam/AdamW reject it (TypeError: '<=' not supported "
        "between 'float' and 'NoneType'). The shim treats None as not passed: torch's default "
        "lr (1e-3, also FusedAdam's), a placeholder the scheduler overwrites."),
    "torch.optim.Adam.state_dict()['state'][i]['step']": (
        "FusedAdam keeps the step count in the param group (group['step']), and the tests seed "
        "optimizer state the FusedAdam way (exp_avg, exp_avg_sq only). On the torch path, "
        "DistributedOptimizer.state_dict reads state['step'] of every parameter "
        "(distrib_optimizer.py, 'Extract step, for non-Apex/TE support'): KeyError: 'step'. "
        "The shim gives each parameter state that has tensors but no 'step', when the state dict "
        "is taken, the step FusedAdam counts for it: its param group's step, else (a group "
        "FusedAdam never counted) the one step of the groups that have one, as megatron-core "
        "aligns FusedAdam's steps, else 0. It goes into the state itself, as torch's Adam keeps "
        "it, so the saved parameter state carries it too. A state with a step keeps its own."),
}


def _accept_lr_none(adam_cls) -> None:
    init = adam_cls.__init__
    signature = inspect.signature(init)
    default = signature.parameters["lr"].default

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("lr", default) is None:
            bound.arguments["lr"] = default
        init(*bound.args, **bound.kwargs)

    adam_cls.__init__ = __init__


def missing_steps(optimizer) -> list:
    """``[(parameter state, step)]`` for the states of a torch ``optimizer`` that have tensors
    but no ``step``: the param group's step, else the one step of the groups that have one,
    else 0 (FusedAdam's count, aligned as megatron-core aligns it; see :data:`SHIMS`)."""
    groups = optimizer.param_groups
    counted = {g["step"] for g in groups if g["params"] and "step" in g}
    fallback = next(iter(counted)) if len(counted) == 1 else 0
    found = []
    for group in groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" not in state:
                found.append((state, group.get("step", fallback)))
    return found


def _state_with_step(adam_cls) -> None:
    import torch

    state_dict = adam_cls.state_dict

    @functools.wraps(state_dict)
    def with_step(self, *args, **kwargs):
        for state, step in missing_steps(self):
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return state_dict(self, *args, **kwargs)

    adam_cls.state_dict = with_step


def apply() -> None:
    """Put every shim of :data:`SHIMS` in place (once; AdamW inherits both from Adam)."""
    import torch

    if getattr(torch.optim.Adam, "__loco_mlm_shims__", False):
        return
    _accept_lr_none(torch.optim.Adam)
    _state_with_step(torch.optim.Adam)
    torch.optim.Adam.__loco_mlm_shims__ = True
