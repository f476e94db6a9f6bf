"""Ranks of the GPU-contract test: the tiny GPT plus :data:`EXTRA` matrices of distinct
sizes (their squares added to the loss) and ``--ddp-bucket-size 1`` (one bucket per parameter:
over 500, each with its own layout, the worst case for a cache), LoCo installed as one case
says, megatron timers at ``--timing-log-level 2``, and every call of the steady steps that
would stall the host or copy pageable memory on a GPU recorded
(:class:`loco_megatron.emulation.host_sync.HostSyncCounter`)."""

import torch

from .worker_megatron import build_gpt, forward_backward, setup

EXTRA = 520
STEPS = 5
STEADY = 3  # steps from here on are checked (warm-up: tables, buffers, first gathers)
CASES = {
    "flat": dict(bits=4),
    "param4": dict(param_bits=4),
    "fp1d": dict(bits=4, full_precision_1d=True),
    "hierarchical": dict(bits=4, hierarchical=True),
}


class _Square(torch.nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((rows, 2), 0.01))

    def forward(self):
        return self.weight.square().sum()


class _WithExtras(torch.nn.Module):
    """The GPT and :data:`EXTRA` ``[i + 3, 2]`` matrices (distinct sizes: distinct bucket
    layouts) whose squared sum joins the loss, each through its own module's forward (where
    megatron's overlapped parameter all-gather hooks in), so every one has a gradient."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        self.extras = torch.nn.ModuleList(_Square(i + 3) for i in range(EXTRA))

    def forward(self, *args, **kwargs):
        return self.gpt(*args, **kwargs) + 1e-3 * sum(m() for m in self.extras)


#: a host sync planted after a LoCo method, compiled as part of the method's own file (so the
#: counter attributes it to LoCo, as it would a real one); ``CALLS[name]`` counts its calls
_PLANT = """
def planted(orig, name, calls):
    def method(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        calls[name] = calls.get(name, 0) + 1
        torch.ones(1).sum().item()  # planted: a host sync (a device tensor's read)
        return out
    return method
"""
#: case -> the methods a sync is planted in for the last step (the mutation test): the
#: compress (run from megatron's backward hooks with overlap on) and the hierarchical
#: inter-node issue (run from the next bucket's hook; overlap on only: with overlap off the
#: reduce-scatter is synchronous and has no handle)
PLANTS = {"flat": ("compress",), "fp1d": ("compress",), "hierarchical": ("compress", "inter")}


def _plant(name: str, calls: dict):
    """Plant :data:`_PLANT` in ``name``'s method (``compress``: ``Compensator.compress``,
    ``inter``: ``HierarchicalWork.issue_inter``); returns a function that removes it."""
    from loco_megatron import compensator, hierarchical

    module, owner, attr = {"compress": (compensator, compensator.Compensator, "compress"),
                           "inter": (hierarchical, hierarchical.HierarchicalWork, "issue_inter")
                           }[name]
    namespace = {"torch": torch}
    exec(compile(_PLANT, module.__file__, "exec"), namespace)
    orig = owner.__dict__[attr]
    setattr(owner, attr, namespace["planted"](orig, name, calls))
    return lambda: setattr(owner, attr, orig)


#: LoCo's host syncs and copies on a logging step with its metrics on
#: (:meth:`loco_megatron.metrics.StepMetrics.reduce`: two tables built and read back), whatever
#: the number of buckets or of steps since the last logging step
LOGGING_BOUND = 4


def contract_worker(rank, world, case, overlap, metrics=False):
    """``{"buckets": n, "steps": [(LoCo's events, their summary, all events)]}`` for the
    steady steps of ``case`` (a key of :data:`CASES`); with ``metrics``, LoCo's telemetry is
    on, every step closes its metrics step and the last step is a logging step (its events
    in ``"logging"``). Then, for a case of :data:`PLANTS`, one more step with a sync planted
    in each of its methods: ``"planted"`` is ``{name: (calls, LoCo's events seen in that
    method's file, summary)}``."""
    import loco_megatron
    from megatron.core.timers import Timers

    from loco_megatron.emulation.host_sync import HostSyncCounter

    setup(1, "gloo")
    state = loco_megatron.install(loco_megatron.LoCoConfig(block_size=64, **CASES[case]))
    if metrics:
        state.enable_metrics()
    timers = Timers(2, "minmax")
    state.timers = lambda: timers
    if state.param_sync is not None:
        state.param_sync.timers = lambda: timers
    try:
        extra = dict(overlap_param_gather=True) if overlap and state.param_active else {}
        model, opt = build_gpt(overlap, 1, dropout=0.0, module_fn=_WithExtras, **extra)
        buckets = sum(len(g.buckets) for g in model.bucket_groups)
        steps, logging = [], None
        for step in range(STEPS):
            counter = HostSyncCounter()
            log_step = metrics and step == STEPS - 1
            with counter:
                forward_backward(model, opt)
                opt.step()
                if metrics:  # what LoCo's training_log hook does every step
                    state.metrics.end_step()
                    if log_step:
                        figures = state.metrics.reduce()
            if log_step:
                logging = (counter.count(owner="loco"), counter.summary(owner="loco"),
                           figures.steps)
            elif step >= STEADY:
                steps.append((counter.count(owner="loco"), counter.summary(owner="loco"),
                              counter.count()))
        planted = {}
        if case in PLANTS and not metrics:
            calls, names = {}, [n for n in PLANTS[case] if overlap or n != "inter"]
            removers = [_plant(name, calls) for name in names]
            counter = HostSyncCounter()
            try:
                with counter:
                    forward_backward(model, opt)
                    opt.step()
            finally:
                for remove in removers:
                    remove()
            files = {"compress": "compensator.py", "inter": "hierarchical.py"}
            for name in names:
                seen = [e for e in counter.events if e.owner == "loco"
                        and e.where.split(":")[0].endswith(files[name])]
                planted[name] = (calls.get(name, 0), len(seen), counter.summary(owner="loco"))
        streams = None
        if overlap and not metrics and case in ("flat", "hierarchical"):
            from loco_megatron.emulation.stream_log import StreamLog

            with StreamLog() as log:  # one more step: where megatron's hooks put LoCo's work
                forward_backward(model, opt)
                opt.step()
            streams = {"hazards": log.hazards[:5], "compress": sorted({
                op.stream.name for op in log.ops if op.name == "loco compress_bucket"})}
        sent = state.wire.calls if state.active else state.param_sync.stats.calls
        return {"buckets": buckets, "steps": steps, "loco_calls": sent, "logging": logging,
                "planted": planted, "streams": streams}
    finally:
        loco_megatron.uninstall()
        torch.distributed.barrier()
