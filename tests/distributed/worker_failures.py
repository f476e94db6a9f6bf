"""Rank workers of test_failure_modes.py: layout agreement at start-up, NaN/Inf in one
rank's gradients with megatron's NaN check off."""

import logging

import torch

from .worker_megatron import build_gpt, forward_backward, setup

#: name -> (rank 0's LoCoConfig kwargs, rank 1's, build_gpt kwargs of rank 0, of rank 1)
MISMATCHES = {
    "block_size": ({"bits": 4}, {"bits": 4, "block_size": 128}, {}, {}),
    "bits_4_vs_8": ({"bits": 4}, {"bits": 8}, {}, {}),
    "bits_4_vs_off": ({"bits": 4}, {"bits": 16}, {}, {}),
    # (megatron-core uses one bucket per buffer unless overlap_grad_reduce)
    "bucket_size": ({"bits": 4}, {"bits": 4}, {"overlap": True},
                    {"overlap": True, "bucket_size": 9000}),
    "grad_dtype": ({"bits": 4}, {"bits": 4}, {}, {"grad_reduce_in_fp32": False,
                                                 "params_dtype": torch.bfloat16}),
    "error_dtype": ({"bits": 4}, {"bits": 4, "error_dtype": "fp32"}, {}, {}),
}


def agreement_worker(rank, world, names):
    """Per mismatch: install this rank's config, build the GPT; return the error message (or
    None) and whether any compressed reduce-scatter ran."""
    import loco_megatron

    setup(1, "gloo")
    out = {}
    for name in names:
        cfgs = MISMATCHES[name]
        state = loco_megatron.install(loco_megatron.LoCoConfig(**cfgs[rank]))
        try:
            build_gpt(**{"overlap": False, **cfgs[2 + rank]})
            out[name] = None
        except loco_megatron.LoCoConfigError as e:
            out[name] = str(e)
        finally:
            out[name + ".calls"] = state.wire.calls
            loco_megatron.uninstall()
    return out


def per_token_loss_worker(rank, world):
    """megatron-core API: a model whose TransformerConfig has calculate_per_token_loss, wrapped
    in DDP under LoCo 4-bit (DP 2) and under LoCo off. Returns the error messages (or None)."""
    import loco_megatron

    def per_token(gpt):
        gpt.config.calculate_per_token_loss = True
        return gpt

    setup(1, "gloo")
    out = {}
    for bits in (4, 16):
        loco_megatron.install(loco_megatron.LoCoConfig(bits=bits))
        try:
            build_gpt(overlap=False, module_fn=per_token)
            out[bits] = None
        except loco_megatron.LoCoConfigError as e:
            out[bits] = str(e)
        finally:
            loco_megatron.uninstall()
    return out


def nan_worker(rank, world, storage):
    """LoCo 4-bit, megatron's check_for_nan_in_grad off: a NaN (step 1) then an inf (step 2)
    written into rank 1's gradient buffer before the reduce-scatter. Returns per step the error
    buffers before/after, the reduced-gradient finiteness and the warnings logged."""
    import loco_megatron

    setup(1, "gloo")
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=64,
                                                           error_dtype=storage))
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("loco_megatron").addHandler(handler)
    try:
        model, opt = build_gpt(overlap=False, dropout=0.0, check_for_nan_in_grad=False)
        buffer = model.buffers[0]
        finish = model.finish_grad_sync
        poison = {1: float("nan"), 2: float("inf")}
        steps = []
        for step in range(4):
            before = {k: {n: t.clone() for n, t in b.tensors().items()}
                      for k, b in state.compensator.errors.items()}
            bad_index = None

            def poisoned_finish(step=step):
                nonlocal bad_index
                if rank == 1 and step in poison:
                    bad_index = 3 * buffer.grad_data.numel() // 4 + 5
                    buffer.grad_data.view(-1)[bad_index] = poison[step]
                finish()

            model.finish_grad_sync = poisoned_finish
            forward_backward(model, opt)
            grads_finite = bool(torch.isfinite(buffer.grad_data).all())
            after = {k: {n: t.clone() for n, t in b.tensors().items()}
                     for k, b in state.compensator.errors.items()}
            steps.append({"before": before, "after": after, "bad_index": bad_index,
                          "grads_finite": grads_finite, "warnings": list(records),
                          "nonfinite": state.compensator.nonfinite_updates()})
            records.clear()
            if step not in poison:
                opt.step()  # a NaN step would make every parameter NaN: not applied
        buckets = [{"key": b.loco_key, "offset": b.offset, "layout": state.layout_for(b, world)}
                   for b in buffer.buckets]
        return {"steps": steps, "buckets": buckets}
    finally:
        logging.getLogger("loco_megatron").removeHandler(handler)
        loco_megatron.uninstall()
