"""Save LoCo training state at one pipeline-parallel size and resume at another (4 ranks).

The tiny 2-layer GPT of worker_pipeline.py, tied embeddings, trained by megatron-core's own
schedule; saved and loaded with worker_ckpt.py's calls (``torch_dist``, the fully
reshardable optimizer format a PP change needs). After each resumed step: every rank's LoCo
step counters and, at PP 2, the drift between the first stage's word embedding and the last
stage's output weight (replicas of one parameter on two pipeline ranks).
"""

import os

from tests.distributed import worker_ckpt
from tests.distributed.worker_pipeline import (MICRO_BATCH, MICROBATCHES, SEQ, _microbatches,
                                               _tied_drift, build_chunks, forward_step,
                                               set_sync_funcs)


def _setup(pp):
    from loco_megatron.emulation import activate
    from loco_megatron.training.workarounds import fix_torch_adamw_resume
    from megatron.core import parallel_state as ps

    activate()
    fix_torch_adamw_resume()  # CPU: torch AdamW fallback (no TE/apex)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)


def pp_resume_worker(rank, world, pp, phase, ckpt_dir, config, steps):
    """``phase`` "save": train ``steps`` and save; "load": load, then train ``steps``.
    Returns ``{"tied_drift": [...], "step_counters": [...], "logs": [...]}``."""
    import loco_megatron
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _setup(pp)
    worker_ckpt._SHARDING["kind"] = "fully"
    state = loco_megatron.install(loco_megatron.LoCoConfig(**config))
    try:
        with worker_ckpt.loco_log_lines() as records:
            chunks, opt, cfg = build_chunks(None, overlap=False, pp=pp)
            set_sync_funcs(chunks, cfg, overlap=False)
            if phase == "load":
                worker_ckpt.load(chunks[0], opt, "torch_dist",
                                 os.path.join(ckpt_dir, "torch_dist"))
            forward_backward, batches = get_forward_backward_func(), _microbatches()
            drift, counters = [], []
            for _ in range(steps):
                chunks[0].zero_grad_buffer()
                opt.zero_grad()
                forward_backward(forward_step_func=forward_step, data_iterator=[iter(batches)],
                                 model=chunks, num_microbatches=MICROBATCHES, seq_length=SEQ,
                                 micro_batch_size=MICRO_BATCH, forward_only=False)
                opt.step()
                drift.append(_tied_drift(chunks) if pp > 1 else 0.0)
                counters.append(sorted(set(state.compensator.stats.steps.values())))
            if phase == "save":
                worker_ckpt.save(chunks[0], opt, "torch_dist",
                                 os.path.join(ckpt_dir, "torch_dist"))
        return {"tied_drift": drift, "step_counters": counters,
                "logs": [r for r in records if r.startswith("LoCo")]}
    finally:
        loco_megatron.uninstall()
