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
    """For each ``(bucket_size, overlap, landed, one_group)``: 2 warm-up steps (error buffers, tables,
    counters), then the live bytes once settled (persistent;
    :meth:`~loco_megatron.emulation.alloc_tracker.AllocationTracker.settle`) and the lower peak
    of two more steps (gloo's worker thread may hold a finished bucket's buffers a moment
    after its ``wait()``: that only adds bytes); ``one_group``: megatron's buckets in one bucket
    group (``partition_buckets(force_single_bucket_group=True)``); ``landed`` (overlap
    on): ``"none"`` or ``"all"`` (:func:`_landed`). Returns per case: buckets, bucket
    groups, measured persistent and peak, the formula's, the start-up line's persistent figure
    and transient range with the formula's (``span``), and the peak's largest live storages
    (``file:line``, bytes) for a failure message."""
    import loco_megatron
    from loco_megatron import collectives
    from loco_megatron.emulation.alloc_tracker import AllocationTracker
    from loco_megatron.megatron import compat
    from loco_megatron.step_memory import step_memory

    import megatron.core.distributed.distributed_data_parallel as ddp_module

    setup(1, "gloo")
    out = []
    real_landed, partition = collectives.LoCoWork.landed, ddp_module.partition_buckets
    for bucket_size, overlap, landed, one_group in cases:
        log = io.StringIO()
        collectives.LoCoWork.landed = _landed(landed) if overlap else real_landed
        if one_group:  # as megatron groups a chunk's buckets (fp8; virtual pipeline chunks > 0)
            ddp_module.partition_buckets = (
                lambda buffers, *a, force_single_bucket_group=False, **k: partition(
                    buffers, *a, force_single_bucket_group=True, **k))
        state = loco_megatron.install(loco_megatron.LoCoConfig(bits=bits))
        with AllocationTracker() as tracker:  # entered after install: its patches on top
            with contextlib.redirect_stdout(log):
                model, opt = build_gpt(True, bucket_size, dropout=0.0, num_layers=1)
            model.ddp_config.overlap_grad_reduce = overlap
            for _ in range(2):
                forward_backward(model, opt)
            gc.collect()
            persistent = tracker.settle()
            peaks = []
            for _ in range(2):  # a worker thread's late release only adds bytes: the lower
                tracker.settle()
                tracker.reset_peak()
                forward_backward(model, opt)
                peaks.append((tracker.peak_bytes, tracker.peak_live))
            peak, at_peak = min(peaks, key=lambda x: x[0])
            at_peak = sorted(at_peak, key=lambda x: -x[1])
        collectives.LoCoWork.landed = real_landed
        ddp_module.partition_buckets = partition
        groups = compat.ddp_bucket_groups(model)
        buckets = [(state.layout_for(b, world), b.grad_data.element_size())
                   for g in groups for b in g.buckets]
        ends = [step_memory(state.config, buckets, overlap=overlap, device="cpu",
                            in_flight=in_flight, groups=[len(g.buckets) for g in groups])
                for in_flight in (1, None)]
        mem = ends[0] if landed == "all" else ends[1]
        line = re.search(r"LoCo memory per rank: persistent (\d+) bytes.*?peak transient "
                         r"(\d+)(?: to (\d+))? bytes", log.getvalue())
        out.append(dict(buckets=len(buckets), groups=len(groups), persistent=persistent, peak=peak,
                        formula=mem, logged=int(line.group(1)) if line else None,
                        logged_transient=(int(line.group(2)), int(line.group(3) or line.group(2)))
                        if line else None, span=tuple(m.transient for m in ends),
                        at_peak=at_peak[:6]))
        loco_megatron.uninstall()
        del model, opt
        gc.collect()
    return out
