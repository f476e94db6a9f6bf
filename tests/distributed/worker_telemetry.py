"""One rank of a megatron-core GPT + DDP + DistributedOptimizer run with LoCo metrics and timers
on, recording an independent reference of every figure (see test_telemetry_grid.py)."""

import torch
import torch.distributed as dist

from .worker_megatron import build_gpt, forward_backward, setup


class Reference:
    """Per step, from the compensator's inputs and state (fp64): this rank's sum of
    ``||h - deQ(Q(h))||^2`` and of ``||e_stored||^2``; and the bytes this rank passed to the
    all-to-alls, minus the chunk each call keeps for itself."""

    def __init__(self, state):
        from tests.helpers.blocks import roundtrip, spans

        self.state, self.err_sq, self.bytes = state, 0.0, 0
        comp, cfg = state.compensator, state.config
        compress = comp.compress

        def recording_compress(key, g_in, layout=None):
            g = g_in if layout is None else layout.to_padded(
                g_in, torch.float64 if g_in.dtype == torch.float64 else torch.float32)
            buf = comp.errors.get(key)
            e_prev = buf.get() if buf is not None else torch.zeros_like(g, dtype=torch.float32)
            h = g.float() + e_prev  # reset_interval is never reached in these runs
            sp = (spans(layout) if layout is not None else
                  torch.full((h.numel() // cfg.block_size,), cfg.block_size))
            deq = roundtrip(h, sp, cfg.bits, torch.float64)
            self.err_sq += float((h.double() - deq).square().sum())
            return compress(key, g_in, layout)

        comp.compress = recording_compress
        a2a = dist.all_to_all_single

        def counting_all_to_all(output, input, *args, **kwargs):
            group = kwargs.get("group")
            world = dist.get_world_size(group)
            self.bytes += input.numel() * input.element_size() * (world - 1) // world
            return a2a(output, input, *args, **kwargs)

        dist.all_to_all_single = counting_all_to_all

    def end_step(self):
        """This step's (err_sq, buf_sq, bytes) on this rank; starts the next step."""
        buf_sq = sum(float(b.get().double().square().sum())
                     for b in self.state.compensator.errors.values())
        row = (self.err_sq, buf_sq, self.bytes)
        self.err_sq, self.bytes = 0.0, 0
        return row


def telemetry_worker(rank, world, tp, overlap, steps=4, window=(1, 3)):
    """Train ``steps`` steps with metrics on; reduce after ``window[0]`` steps and after the
    rest. Returns the figures, the reference rows of all ranks, stock bytes and timer names."""
    import loco_megatron
    from megatron.core.timers import Timers

    setup(tp, "gloo")
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=64))
    try:
        metrics = state.enable_metrics()
        timers = Timers(2, "minmax")
        state.timers = lambda: timers
        ref = Reference(state)
        model, opt = build_gpt(overlap, bucket_size=8000)
        stock = sum(b.grad_data.numel() // world_dp() * b.grad_data.element_size()
                    * (world_dp() - 1) for g in model.bucket_groups for b in g.buckets)
        rows, figures = [], []
        for step in range(steps):
            forward_backward(model, opt)
            opt.step()
            metrics.end_step()
            rows.append(ref.end_step())
            if step + 1 == window[0] or step + 1 == sum(window):
                figures.append(metrics.reduce())
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        return {"figures": figures, "rows": gathered, "stock_per_step": stock,
                "timers": sorted(n for n in timers._timers if n.startswith("loco-")),
                "num_buckets": state.num_buckets}
    finally:
        loco_megatron.uninstall()


def world_dp() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()
