"""Ranks of the memory test: LoCo's live bytes in a steady step of the tiny GPT, measured by
:class:`~loco_megatron.emulation.alloc_tracker.AllocationTracker` under the CPU emulation, beside
:func:`loco_megatron.step_memory.step_memory` and the start-up line's figures.

Megatron makes one bucket per buffer without ``overlap_grad_reduce`` (its DDP sets
``bucket_size`` None), so every model is built with overlap on and ``overlap_grad_reduce`` is
turned off afterwards for the cases without: megatron then reduces the same buckets
synchronously from ``finish_grad_sync``."""

import contextlib
import gc
import io
import re

from .worker_megatron import build_gpt, forward_backward, setup


def _landed(mode):
    """``LoCoWork.landed`` made deterministic: ``"none"``, no all-to-all lands before the end
    of backward (the formula's bound); ``"all"``, each has landed by the next launch (waited
    for here, on the host)."""
    def landed(self):
        if mode == "none":
            return False
        for w in self._works:
            if w is not None:
                w.wait()
        return True
    return landed


def memory_worker(rank, world, cases, bits=4):
    """For each ``(bucket_size, overlap, landed)``: 2 warm-up steps (error buffers, tables,
    counters), then the live bytes (persistent) and one more step's peak; ``landed`` (overlap
    on): ``"none"`` or ``"all"`` (:func:`_landed`). Returns per case: buckets, measured
    persistent and peak, the formula's, the start-up line's persistent figure, and the peak's
    largest live storages (``file:line``, bytes) for a failure message."""
    import loco_megatron
    from loco_megatron import collectives
    from loco_megatron.emulation.alloc_tracker import AllocationTracker
    from loco_megatron.megatron import compat
    from loco_megatron.step_memory import step_memory

    setup(1, "gloo")
    out = []
    real_landed = collectives.LoCoWork.landed
    for bucket_size, overlap, landed in cases:
        log = io.StringIO()
        collectives.LoCoWork.landed = _landed(landed) if overlap else real_landed
        state = loco_megatron.install(loco_megatron.LoCoConfig(bits=bits))
        with AllocationTracker() as tracker:  # entered after install: its patches on top
            with contextlib.redirect_stdout(log):
                model, opt = build_gpt(True, bucket_size, dropout=0.0, num_layers=1)
            model.ddp_config.overlap_grad_reduce = overlap
            for _ in range(2):
                forward_backward(model, opt)
            gc.collect()
            persistent = tracker.sweep()
            tracker.reset_peak()
            forward_backward(model, opt)
            peak, at_peak = tracker.peak_bytes, sorted(tracker.peak_live, key=lambda x: -x[1])
        collectives.LoCoWork.landed = real_landed
        buckets = [(state.layout_for(b, world), b.grad_data.element_size())
                   for g in compat.ddp_bucket_groups(model) for b in g.buckets]
        mem = step_memory(state.config, buckets, overlap=overlap, device="cpu",
                          in_flight=1 if landed == "all" else None)
        line = re.search(r"LoCo memory per rank: persistent (\d+) bytes", log.getvalue())
        out.append(dict(buckets=len(buckets), persistent=persistent, peak=peak,
                        formula=mem, logged=int(line.group(1)) if line else None,
                        at_peak=at_peak[:6]))
        loco_megatron.uninstall()
        del model, opt
        gc.collect()
    return out
