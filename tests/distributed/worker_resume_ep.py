"""Save LoCo training state of the tiny MoE GPT at one expert-parallel size and resume at
another (4 ranks, ``torch_dist``, the fully reshardable optimizer format as Megatron-LM's
``--dist-ckpt-optim-fully-reshardable`` saves it; worker_moe.py). Records every rank's LoCo
step counters after each resumed step and the LoCo log lines."""

import os

from tests.distributed.worker_ckpt import loco_log_lines
from tests.distributed.worker_megatron import forward_backward


def _load_fully_reshardable(model, opt, ckpt_dir) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from loco_megatron.megatron import compat

    compat.init_optimizer_states_for_load(opt)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                "chained_optim_avoid_prefix": True, "dp_cp_group": ps.get_data_parallel_group()}
    model_sd = model.module.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True,
                                                                metadata=metadata)}, ckpt_dir)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def ep_resume_worker(rank, world, ep, phase, ckpt_dir, config, steps):
    """``phase`` "save": train ``steps`` and save; "load": load, then train ``steps``."""
    import loco_megatron
    import tests.distributed.worker_moe as wm
    from loco_megatron.training.workarounds import fix_torch_adamw_resume

    wm.EP = ep
    wm.setup_moe()
    fix_torch_adamw_resume()
    state = loco_megatron.install(loco_megatron.LoCoConfig(**config))
    try:
        with loco_log_lines() as records:
            model, opt = wm.build_moe_gpt(False)
            if phase == "load":
                _load_fully_reshardable(model, opt, ckpt_dir)
            counters = []
            for _ in range(steps):
                forward_backward(model, opt)
                opt.step()
                counters.append(sorted(set(state.compensator.stats.steps.values())))
            if phase == "save":
                wm._save_fully_reshardable(model, opt, ckpt_dir)
        return {"step_counters": counters,
                "logs": [r for r in records if r.startswith("LoCo")]}
    finally:
        loco_megatron.uninstall()
