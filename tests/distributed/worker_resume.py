"""Save a LoCo-trained megatron-core model in both checkpoint formats, load each into a fresh
model, and compare error buffers and the next steps with the uninterrupted run.

Shared by worker_moe.py and worker_instances.py; the save and load calls are
worker_ckpt.py's (megatron-core's own checkpoint calls, as ``megatron.training`` makes
them).
"""

import os

import torch

from tests.distributed.worker_megatron import forward_backward

FORMATS = ("torch_dist", "torch")


def errors(state):
    """Every bucket's stored error tensors (int8 codes + fp32 scales, or fp32 values)."""
    return {key: {k: t.cpu().clone() for k, t in buf.tensors().items()}
            for key, buf in state.compensator.errors.items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def two_more_steps(model, opt):
    """Losses of two further steps (the second depends on the reduced gradients, so on the
    error buffers and the optimizer state)."""
    first = float(forward_backward(model, opt))
    opt.step()
    return [first, float(forward_backward(model, opt))]


def save_then_resume(model, opt, state, build, config, ckpt_dir, groups):
    """Save ``model``/``opt`` (trained under the installed ``state``) in every format, train
    two more steps, uninstall; then per format install ``config`` again, ``build()`` a fresh
    model + optimizer, load, compare and train the same two steps.

    Args:
        groups: ``{name: set of LoCo bucket keys}``; each name's buffers are compared.

    Returns:
        ``{"continued": losses, "nonzero": {name: bool}, fmt: {"same_keys": bool,
        name: bool (every buffer bit-equal), "resumed": losses}}``.
    """
    import loco_megatron
    from tests.distributed.worker_ckpt import load, save

    try:
        before = errors(state)
        for fmt in FORMATS:
            save(model, opt, fmt, os.path.join(ckpt_dir, fmt))
        out = {"continued": two_more_steps(model, opt),
               "nonzero": {name: all(any(float(t.abs().max()) > 0 for t in before[k].values())
                                     for k in keys) for name, keys in groups.items()}}
    finally:
        loco_megatron.uninstall()
    for fmt in FORMATS:
        state = loco_megatron.install(config)
        try:
            model2, opt2 = build()
            load(model2, opt2, fmt, os.path.join(ckpt_dir, fmt))
            after = errors(state)
            out[fmt] = {"same_keys": sorted(before) == sorted(after),
                        **{name: all(_same(before[k], after.get(k, {})) for k in keys)
                           for name, keys in groups.items()},
                        "resumed": two_more_steps(model2, opt2)}
        finally:
            loco_megatron.uninstall()
    return out
