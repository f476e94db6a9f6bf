"""Train the tiny GPT, save or load its optimizer state (with LoCo's error buffers) through
megatron-core's own checkpoint calls, as ``megatron.training.checkpointing`` makes them.

``fmt="torch"``: ``DistributedOptimizer.state_dict`` + ``save_parameter_state`` (and the load
counterparts); ``fmt="torch_dist"``: ``sharded_state_dict`` (``dp_reshardable``; on
megatron-core 0.13/0.14, which lack it, ``fully_sharded_model_space``) +
``dist_checkpointing.save`` / ``load``.
"""

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from loco_megatron.megatron import compat
from tests.distributed.worker_megatron import build_gpt, forward_backward, setup, tp_drift


_SHARDING = {}


def _sharding():
    """The optimizer's sharding type: ``dp_reshardable`` by default, or what the running job's
    ``"sharding": "fully"`` asked for (a TP change: ``--dist-ckpt-optim-fully-reshardable``)."""
    kind = _SHARDING.get("kind")
    return {"distrib_optim_sharding_type": compat.fully_reshardable_sharding_type()
            if kind == "fully" else compat.reshardable_sharding_type()}


@contextlib.contextmanager
def loco_log_lines():
    """The list of messages logged under ``loco_megatron`` while the block runs."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("loco_megatron").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("loco_megatron").removeHandler(handler)


def _torch_paths(ckpt_dir):
    from megatron.core import parallel_state as ps

    d = os.path.join(ckpt_dir, f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}")
    if ps.get_expert_model_parallel_world_size() > 1:  # as megatron.training's checkpoint names
        d += f"_{ps.get_expert_model_parallel_rank():03d}"
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, "model_optim.pt"), os.path.join(d, "distrib_optim.pt")


def save(model, opt, fmt, ckpt_dir):
    """Save model + optimizer state (all ranks call)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if fmt == "torch":
        common, param_state = _torch_paths(ckpt_dir)
        opt.save_parameter_state(param_state)
        if ps.get_expert_data_parallel_rank() == 0:  # one writer per directory
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, common)
        dist.barrier()
        return
    os.makedirs(ckpt_dir, exist_ok=True)
    model_sd = model.module.sharded_state_dict()
    metadata = {**_sharding(), "dp_cp_group": ps.get_data_parallel_group()}
    dist_checkpointing.save({"model": model_sd,
                             "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata)},
                            ckpt_dir)


@torch.no_grad()
def load(model, opt, fmt, ckpt_dir, strict=None, via_ddp=False):
    """Load what :func:`save` wrote into a freshly built model and optimizer (``strict``: the
    ``dist_checkpointing.load`` strictness, Megatron-LM's ``--dist-ckpt-strictness``; None:
    megatron-core's default; ``via_ddp``: the ``torch_dist`` model state goes through the DDP
    model's ``load_state_dict``, as Megatron-LM's ``load_checkpoint`` does)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    compat.init_optimizer_states_for_load(opt)
    if fmt == "torch":
        common, param_state = _torch_paths(ckpt_dir)
        state = torch.load(common, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        opt.load_parameter_state(param_state)
        return
    model_sd = model.module.sharded_state_dict()
    metadata = {**_sharding(), "dp_cp_group": ps.get_data_parallel_group()}
    sd = {"model": model_sd,
          "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(sd, ckpt_dir, **({} if strict is None else
                                                       {"strict": strict}))
    if isinstance(loaded, tuple):  # return_unexpected / return_all: (state, missing, unexpected)
        loaded, missing, unexpected = loaded
        assert not missing and not unexpected, (missing, unexpected)
    (model if via_ddp else model.module).load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def load_model_only(model, ckpt_dir):
    """A model-only ``torch_dist`` load through the DDP model (``--finetune``,
    ``--no-load-optim``, a base-weights load)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, ckpt_dir)
    model.load_state_dict(loaded["model"])


def errors(state):
    """Each bucket's stored error tensors and its decoded fp64 values."""
    if state is None or not state.active:
        return {}
    return {key: {**{k: t.cpu().clone() for k, t in buf.tensors().items()},
                  "decoded": buf.get().double().cpu()}
            for key, buf in state.compensator.errors.items()}


def dp_sum(state):
    """DP-sum (fp64) of every bucket's error, mapped back to the bucket's index space."""
    out = {}
    for key, layout in sorted(state.layouts.items()):
        if key not in state.compensator.errors:
            continue
        e = state.compensator.errors[key].get().double()
        dist.all_reduce(e, group=_dp_group())
        full = torch.zeros(layout.numel, dtype=torch.float64)
        for r in range(layout.world):
            shard = torch.zeros(layout.shard, dtype=torch.float64)
            layout.from_padded_shard(e[r * layout.padded_shard:(r + 1) * layout.padded_shard].cpu(),
                                     r, shard)
            full[r * layout.shard:(r + 1) * layout.shard] = shard
        out[key] = full
    return out


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def _run_job(job, records):
    import loco_megatron

    state = None  # config None: stock megatron-core, loco_megatron not installed
    _SHARDING["kind"] = job.get("sharding")
    if job["config"] is not None:
        state = loco_megatron.install(loco_megatron.LoCoConfig(**job["config"]))
    try:
        model, opt = build_gpt(**{"overlap": False, "dropout": 0.0, **job.get("ddp", {})})
        out = {}
        if job["phase"] == "load":
            error = None
            try:
                if job.get("model_first"):  # a model-only load first, in the same process
                    load_model_only(model, job["dir"])
                load(model, opt, job["format"], job["dir"], job.get("strict"),
                     job.get("via_ddp", False))
            except BaseException as e:  # torch DCP raises CheckpointException(BaseException)
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                error = f"{type(e).__name__}: {e}"
                if os.environ.get("LOCO_TEST_TRACEBACK"):
                    import traceback
                    traceback.print_exc()
            failed = torch.tensor([error is not None], dtype=torch.int32)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # no rank trains on if one failed
            if failed.item():
                return {"error": error or "another rank failed to load",
                        "logs": [r for r in records if r.startswith("LoCo")]}
            out["sum_after_load"] = dp_sum(state) if state and state.active else {}
            out["errors_after_load"] = errors(state)
        active = state is not None and state.active
        calls0 = state.compensator.stats.calls if active else 0
        losses, drift, counters = [], [], []
        for _ in range(job["steps"]):
            losses.append(float(forward_backward(model, opt)))
            opt.step()
            if job.get("tp_drift"):  # after every step: replicas across TP ranks
                drift.append(tp_drift(model))
                counters.append(sorted(set(state.compensator.stats.steps.values()))
                                if state and state.active else [])
        if job.get("tp_drift"):
            out.update(tp_drift=drift, step_counters=counters)
        if job["phase"] == "save":
            out["sum_before_save"] = dp_sum(state) if state and state.active else {}
            for fmt in job["formats"]:
                save(model, opt, fmt, os.path.join(job["dir"], fmt))
        out.update(losses=losses, errors=errors(state),
                   params={n: p.detach().cpu().clone() for n, p in model.module.named_parameters()},
                   steps=dict(state.compensator.stats.steps) if state and state.active else {},
                   resets=state.compensator.stats.resets if state and state.active else 0,
                   calls=state.compensator.stats.calls - calls0 if active else 0,
                   logs=[r for r in records if r.startswith("LoCo")])
        return out
    finally:
        loco_megatron.uninstall()


def ckpt_worker(rank, world, tp, jobs):
    """Run ``jobs`` in order on one rank; each job builds a fresh model under its own install().

    A job: ``{"phase": "straight" | "save" | "load", "config": LoCoConfig kwargs, "steps": n,
    "dir": checkpoint directory, "formats": [...] (save) or "format": fmt (load); a load may
    add "via_ddp" and "model_first": :func:`load_model_only` before the full load}``. "save"
    trains then saves to ``dir/<format>``; "load" loads ``dir`` then trains. Returns one dict
    per job: losses, params, error buffers, step counters, resets, "LoCo..." log lines, the
    DP-sum of the errors before saving / after loading, or ``{"error": message}`` when a load
    raised.
    """
    from loco_megatron.training.workarounds import fix_torch_adamw_resume

    setup(tp, "gloo")
    fix_torch_adamw_resume()  # CPU: torch AdamW fallback (no TE/apex)
    results = []
    for job in jobs:
        with loco_log_lines() as records:
            results.append(_run_job(job, records))
    return results
