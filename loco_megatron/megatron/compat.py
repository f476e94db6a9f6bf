"""Version adapter: every megatron-core name the plugin touches, found in one place.

Supported (docs/compatibility.md): megatron-core 0.19.x (Python 3.12, wheel with
``megatron.training``) and 0.13.x-0.16.x (Python 3.11; wheels before 0.17 ship no
``megatron.training``, so the main job needs a Megatron-LM checkout there). What differs, and is
handled here (sources: megatron/core/... of each release tag):

* ``_ParamAndGradBucketGroup.start_grad_sync``: ``(self)`` up to 0.15,
  ``(self, force_all_reduce=False)`` from 0.16 (:func:`force_all_reduce`);
* ``DistributedOptimizer.sharded_state_dict``: ``model_sharded_state_dict`` required in 0.13,
  default ``{}`` later (the hook always passes it); the ``dp_reshardable`` sharding type exists
  from 0.15 (:func:`reshardable_sharding_type`);
* ``DistributedOptimizer._init_optimizer_states_with_dummy_values``: from 0.14; backported
  for 0.13 (:func:`init_optimizer_states_for_load`);
* ``DistributedOptimizer.optimizer_state_keys``: 0.19; Adam's two keys before
  (:func:`optimizer_state_keys`);
* ``dist_checkpointing.load`` keywords: ``common_strategy`` up to 0.16, ``process_group`` and
  ``verify_integrity`` in 0.19 (the hook passes them through untouched);
* uneven ``ShardedTensor`` s (``axis_fragmentations=None``, e.g. LoCo's summed error, whose
  last DP shard is shorter): saved by ``torch_dist`` from 0.15; 0.13/0.14 need a regular grid,
  so there the summed error is not saved in ``torch_dist`` checkpoints
  (:func:`supports_uneven_sharded_tensors`; the ``torch`` format keeps it on every version);
* ``megatron.training``: in the wheels from 0.17 (:func:`require_megatron_training`).

The plugin only passes ``*args, **kwargs`` through megatron-core's signatures, so keyword sets
that differ need no code; positional differences and absent features are resolved by the
functions below (by feature, not by version number, where the feature can be seen).
"""

import importlib
import importlib.util
from typing import Dict, Tuple

#: first megatron-core wheel that ships ``megatron.training``
FIRST_WITH_TRAINING = (0, 17)
#: the wrapper that runs a Megatron-LM checkout's own ``pretrain_gpt.py`` with LoCo
CHECKOUT_WRAPPER = "python -m loco_megatron.training.run_megatron_lm --megatron-lm /path/to/Megatron-LM"


def megatron_core_version() -> tuple:
    """``(major, minor, patch)`` of the installed megatron-core, e.g. ``(0, 16, 1)``."""
    from importlib.metadata import PackageNotFoundError, version

    try:  # the distribution's metadata: no import of megatron.core (and its warnings)
        text = version("megatron-core")
    except PackageNotFoundError:  # a Megatron-LM checkout on sys.path
        from megatron.core import package_info

        text = package_info.__version__
    return tuple(int(x) for x in text.split(".")[:3] if x.isdigit())


def has_megatron_training() -> bool:
    """True when ``megatron.training`` is importable (megatron-core >= 0.17 wheels, or a
    Megatron-LM checkout on ``sys.path``)."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def missing_megatron_training(entry: str = "loco_megatron.training.pretrain_gpt"):
    """None when ``megatron.training`` is importable, else the message saying what to do: the
    installed megatron-core version and the Megatron-LM checkout wrapper to use instead."""
    if has_megatron_training():
        return None
    version = ".".join(map(str, megatron_core_version()))
    return (f"{entry} needs megatron.training, which is not in this megatron-core {version} "
            f"wheel (wheels ship it from {'.'.join(map(str, FIRST_WITH_TRAINING))} on). Use a "
            f"Megatron-LM checkout of the matching release instead: {CHECKOUT_WRAPPER} ... (or "
            f"set MEGATRON_LM=/path/to/Megatron-LM), or install megatron-core 0.19.x on Python "
            f"3.12 (bash install.sh).")


def require_megatron_training(entry: str = "loco_megatron.training.pretrain_gpt") -> None:
    """Fail early when ``megatron.training`` (the main job's training loop) is missing.

    Raises:
        RuntimeError: with :func:`missing_megatron_training`'s message.
    """
    message = missing_megatron_training(entry)
    if message:
        raise RuntimeError(message)


def bucket_param_ranges(buffer, bucket) -> Dict[object, Tuple[int, int]]:
    """Bucket-local ``(start, end)`` of each parameter's gradient inside ``bucket.grad_data``.

    From the buffer's ``param_index_map`` (``param -> (start, end, bucket_id)`` in the whole
    buffer, megatron/core/distributed/param_and_grad_buffer.py, 0.13-0.19) minus the bucket's
    ``offset``. megatron-core 0.17+ derives ``bucket.param_to_index`` the same way; 0.13-0.16
    computed it as a running sum of ``param.numel()`` that ignores the distributed optimizer's
    padding of each parameter's start (to a multiple of 64 elements), so there it points into
    the wrong elements of ``grad_data``. LoCo cuts its quantization blocks at these boundaries:
    with the wrong ones a tensor-parallel-replicated parameter (LayerNorm, row-parallel bias)
    shared a scale with a TP-sharded neighbour and its copies drifted apart across TP ranks.

    Args:
        buffer: the ``_ParamAndGradBuffer`` that owns ``bucket``.
        bucket: a ``_ParamAndGradBucket``.

    Returns:
        ``{param: (start, end)}``, element offsets into ``bucket.grad_data``.
    """
    offset = int(bucket.offset)
    return {param: (int(buffer.param_index_map[param][0]) - offset,
                    int(buffer.param_index_map[param][1]) - offset)
            for param in bucket.params_list}


def param_and_grad_buffer_module():
    """``megatron.core.distributed.param_and_grad_buffer`` (holds ``dist_reduce_scatter_func``,
    the module global that ``start_grad_sync`` calls for each bucket; 0.13-0.19)."""
    return importlib.import_module("megatron.core.distributed.param_and_grad_buffer")


def bucket_group_class():
    """``_ParamAndGradBucketGroup``, whose ``start_grad_sync`` launches the bucket reduce."""
    return param_and_grad_buffer_module()._ParamAndGradBucketGroup


def force_all_reduce(args: tuple, kwargs: dict) -> bool:
    """The ``force_all_reduce`` argument of a ``start_grad_sync(*args, **kwargs)`` call
    (0.16+: first positional or keyword, default False; 0.13: no such argument, so False)."""
    return bool(kwargs.get("force_all_reduce", args[0] if args else False))


def ddp_class():
    """megatron-core's ``DistributedDataParallel``."""
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


def ddp_buffers(ddp) -> list:
    """``ddp.buffers + ddp.expert_parallel_buffers`` (the stable buffer order LoCo keys use)."""
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


def ddp_bucket_groups(ddp) -> list:
    """``ddp.bucket_groups + ddp.expert_parallel_bucket_groups``."""
    return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))


def reduce_scatter_group(bucket_group):
    """``(process group, size)`` a bucket group reduce-scatters its gradients over, or None when
    it does not reduce-scatter (plain DDP all-reduces over ``data_parallel_group``).

    megatron-core sets ``intra_distributed_optimizer_instance_{group,size}`` only with the
    distributed optimizer or ``overlap_param_gather`` (the layer-wise optimizer, which all-reduces;
    param_and_grad_buffer.py ``_ParamAndGradBucketGroup.__init__``, 0.13-0.19), so this reads
    them only where ``ddp_config.use_distributed_optimizer`` says they exist and are used.
    """
    if not bucket_group.ddp_config.use_distributed_optimizer:
        return None
    return (bucket_group.intra_distributed_optimizer_instance_group,
            int(bucket_group.intra_distributed_optimizer_instance_size))


def param_gather_rank(bucket_group) -> int:
    """This rank's index in the group a bucket group all-gathers its parameters over
    (``intra_distributed_optimizer_instance_rank``, 0.13-0.19; the shard it owns)."""
    return int(bucket_group.intra_distributed_optimizer_instance_rank)


def gradient_group_size(bucket_group) -> int:
    """Ranks a bucket group's gradient reduction spans (reduce-scatter with the distributed
    optimizer, all-reduce without; 1: nothing is sent)."""
    rs = reduce_scatter_group(bucket_group)
    if rs is not None:
        return rs[1]
    group = getattr(bucket_group, "data_parallel_group", None)
    return 1 if group is None else int(group.size())


def stock_reduce_scatter_funcs() -> tuple:
    """The functions megatron-core's ``dist_reduce_scatter_func`` is bound to at import:
    ``torch.distributed.distributed_c10d.reduce_scatter_tensor`` or, on old torch,
    ``_reduce_scatter_base`` (param_and_grad_buffer.py, 0.13-0.19). Anything else there was put by someone else (another
    plugin, a test's mock, megatron's own ``reduce_scatter_with_fp32_accumulation``)."""
    from torch.distributed import distributed_c10d as c10d

    # c10d's own attributes, not ``torch.distributed.*``: a tool that wraps the package's
    # attribute after megatron-core was imported changes nothing megatron calls
    return tuple(f for f in (getattr(c10d, "reduce_scatter_tensor", None),
                             getattr(c10d, "_reduce_scatter_base", None)) if f is not None)


def stock_all_gather_funcs() -> tuple:
    """The functions megatron-core's ``dist_all_gather_func`` is bound to at import:
    ``all_gather_into_tensor`` or, on old torch, ``_all_gather_base`` of
    ``torch.distributed.distributed_c10d`` (param_and_grad_buffer.py, 0.13-0.19)."""
    from torch.distributed import distributed_c10d as c10d

    return tuple(f for f in (getattr(c10d, "all_gather_into_tensor", None),
                             getattr(c10d, "_all_gather_base", None)) if f is not None)


def distributed_optimizer_class():
    """``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def chained_optimizer_class():
    """``megatron.core.optimizer.optimizer.ChainedOptimizer``."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    return ChainedOptimizer


def dist_checkpointing_load_owners() -> list:
    """The modules whose ``load`` attribute is megatron-core's distributed-checkpoint load
    (``megatron.core.dist_checkpointing`` re-exports ``serialization.load``; callers use
    either name)."""
    return [importlib.import_module("megatron.core.dist_checkpointing"),
            importlib.import_module("megatron.core.dist_checkpointing.serialization")]


def reshardable_sharding_type() -> str:
    """The DistributedOptimizer ``distrib_optim_sharding_type`` to save with when the DP size
    may change: ``dp_reshardable`` (0.15+) or, before, ``fully_sharded_model_space`` (that release's default)."""
    cls = distributed_optimizer_class()
    if hasattr(cls, "load_parameter_state_from_dp_reshardable"):
        return "dp_reshardable"
    return "fully_sharded_model_space"


def fully_reshardable_sharding_type() -> str:
    """The DistributedOptimizer ``distrib_optim_sharding_type`` a TP/PP change needs
    (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``): ``fully_reshardable`` (0.15+,
    ``DistributedOptimizer.checkpoint_fully_reshardable_formats``) or, before,
    ``fully_sharded_model_space``."""
    formats = getattr(distributed_optimizer_class(), "checkpoint_fully_reshardable_formats", ())
    return "fully_reshardable" if "fully_reshardable" in formats else "fully_sharded_model_space"


def optimizer_state_keys(optimizer) -> tuple:
    """The per-parameter optimizer-state tensors a DistributedOptimizer checkpoints:
    ``optimizer.optimizer_state_keys`` (0.19) or Adam's ``("exp_avg", "exp_avg_sq")`` (the
    keys hard-coded in 0.13-0.16's ``get_parameter_state_*``)."""
    return tuple(getattr(optimizer, "optimizer_state_keys", ("exp_avg", "exp_avg_sq")))


def init_optimizer_states_for_load(optimizer) -> None:
    """Allocate the optimizer states before a checkpoint load, as Megatron-LM's checkpointing
    does: ``_init_optimizer_states_with_dummy_values()`` of each (chained) DistributedOptimizer
    (megatron-core 0.14+), or on 0.13 the same steps backported (zero gradients, one
    ``optimizer.step()``, ``zero_grad()``; distrib_optimizer.py of core_v0.14.0). Without it,
    0.13's ``state_dict()`` on the torch-optimizer fallback (no TE/apex) asserts on the missing
    per-parameter ``step``. Parameters are overwritten by the load that follows."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None:
            init()
            continue
        import torch

        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                if param.numel():
                    param.grad = torch.zeros_like(param)
        opt.optimizer.step()
        opt.optimizer.zero_grad()


def optimizer_instances(optimizer) -> tuple:
    """``(instances, this rank's instance id, inter-instance group or None)`` of a
    DistributedOptimizer: ``ddp_config.num_distributed_optimizer_instances``,
    ``distributed_optimizer_instance_id`` and its first model chunk's ``inter_dist_opt_group``
    (megatron/core/optimizer/distrib_optimizer.py and distributed/distributed_data_parallel.py,
    0.13-0.19)."""
    count = int(getattr(getattr(optimizer, "ddp_config", None),
                        "num_distributed_optimizer_instances", 1) or 1)
    if count == 1:
        return 1, 0, None
    return (count, int(optimizer.distributed_optimizer_instance_id),
            optimizer.model_chunks[0].inter_dist_opt_group)


def dist_checkpointing_mapping():
    """``megatron.core.dist_checkpointing.mapping`` (``ShardedTensor``, ``ShardedObject``,
    ``LocalNonpersistentObject``; same constructors 0.13-0.19)."""
    return importlib.import_module("megatron.core.dist_checkpointing.mapping")


def supports_uneven_sharded_tensors() -> bool:
    """Whether ``torch_dist`` saves ``ShardedTensor`` s off a regular grid (0.15+:
    ``ShardedTensor.has_regular_grid`` and ``CheckpointableShardedTensor`` in
    dist_checkpointing/strategies/torch.py); before, every shard must have the same shape."""
    return hasattr(dist_checkpointing_mapping().ShardedTensor, "has_regular_grid")


def dist_checkpointing_serialization():
    """``megatron.core.dist_checkpointing.serialization``: its ``load`` reads the checkpoint's
    keys through the module global ``load_sharded_metadata`` for the strict-load check
    (``StrictHandling``; the same in 0.13-0.19)."""
    return importlib.import_module("megatron.core.dist_checkpointing.serialization")


def load_sharded_metadata(checkpoint_dir: str) -> dict:
    """``{key: ShardedTensor | ShardedObject}`` saved in a distributed checkpoint
    (``megatron.core.dist_checkpointing.serialization.load_sharded_metadata``, 0.13-0.19)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata as load

    return load(checkpoint_dir)


def tensor_parallel_random_module():
    """``megatron.core.tensor_parallel.random`` (``CudaRNGStatesTracker``, ``_lazy_call``) for
    the CPU emulation, or None when megatron-core is not installed."""
    try:
        return importlib.import_module("megatron.core.tensor_parallel.random")
    except ImportError:
        return None
