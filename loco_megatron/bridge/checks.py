"""LoCo's refusals and preflight for a Megatron-Bridge ``ConfigContainer``, in Bridge's words.

The checks are the other launch paths' own (:func:`loco_megatron.cli.preflight.check_megatron_args`
on a namespace of the Megatron-LM argument names, :func:`megatron_args`), run before Bridge's
``pretrain`` starts; their lines name Bridge's settings instead of Megatron-LM's flags
(:func:`in_bridge_words`). Added here: the checkpoint formats LoCo's state does not travel in
(:func:`check_checkpointing`).
"""

import argparse
import os
import re

from ..config import ERROR_DTYPES, GRIDS, KERNEL_CHOICES, LoCoConfig, LoCoConfigError

#: Megatron-LM flag -> the Bridge ``ConfigContainer`` setting it is (messages)
BRIDGE_NAMES = {
    "--use-distributed-optimizer": "ddp.use_distributed_optimizer=True",
    "--ddp-reduce-scatter-with-fp32-accumulation": "ddp.reduce_scatter_with_fp32_accumulation",
    "--calculate-per-token-loss": "model.calculate_per_token_loss",
    "--use-megatron-fsdp": "ddp.use_megatron_fsdp",
    "--use-custom-fsdp": "ddp.use_megatron_fsdp",
    "--use-torch-fsdp2": "dist.use_torch_fsdp2",
    "--fp8-param-gather": "ddp.fp8_param_gather",
    "--fp4-param-gather": "ddp.fp4_param_gather",
    "--use-precision-aware-optimizer": "optimizer.use_precision_aware_optimizer",
    "--cuda-graph-impl": "model.cuda_graph_impl",
    "--cuda-graph-scope": "model.cuda_graph_scope",
    "--async-save": "checkpoint.async_save",
}

#: what may follow a ``--loco-*`` flag in a message as its value (a number or a choice)
_VALUE = "|".join([r"-?\d[\w.]*"] + [re.escape(c) for c in
                                     GRIDS + ERROR_DTYPES + KERNEL_CHOICES])

#: ``checkpoint.ckpt_format`` values LoCo's state is saved and loaded in through Bridge
SUPPORTED_FORMATS = ("torch_dist",)


def in_bridge_words(message: str) -> str:
    """A refusal line with Megatron-LM's flags replaced by Bridge's settings
    (``--loco-bits 3`` -> ``loco.bits=3``, ``--use-distributed-optimizer`` ->
    ``ddp.use_distributed_optimizer=True``)."""
    for flag, name in BRIDGE_NAMES.items():
        message = re.sub(re.escape(flag) + r"(?![\w-])", name, message)
    return re.sub(r"--loco-([a-z0-9-]+)(?: ({}))?(?=[\s:;,)]|$)".format(_VALUE),
                  lambda m: f"loco.{m.group(1)}" + (f"={m.group(2)}" if m.group(2) else ""),
                  message)


def megatron_args(cfg, world_size: int = None) -> argparse.Namespace:
    """The Megatron-LM argument names LoCo's checks read, from a Bridge ``ConfigContainer``
    (``cfg.model``, ``cfg.ddp``, ``cfg.optimizer``, ``cfg.dist``; megatron/bridge/training/
    config.py). ``world_size``: default ``$WORLD_SIZE`` (the launcher's), else counted as a
    data-parallel group of more than one rank."""
    model, ddp, dist = cfg.model, cfg.ddp, cfg.dist
    opt = cfg.optimizer
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "0") or 0)
    get = getattr
    tp, pp = get(model, "tensor_model_parallel_size", 1) or 1, get(model, "pipeline_model_parallel_size", 1) or 1
    cp = get(model, "context_parallel_size", 1) or 1
    args = argparse.Namespace(
        use_distributed_optimizer=bool(get(ddp, "use_distributed_optimizer", False)
                                       or get(opt, "use_distributed_optimizer", False)),
        ddp_reduce_scatter_with_fp32_accumulation=get(ddp, "reduce_scatter_with_fp32_accumulation", False),
        calculate_per_token_loss=get(model, "calculate_per_token_loss", False),
        num_distributed_optimizer_instances=get(ddp, "num_distributed_optimizer_instances", 1),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        num_experts=get(model, "num_moe_experts", None),
        expert_model_parallel_size=get(model, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=get(model, "expert_tensor_parallel_size", None),
        cuda_graph_impl=get(model, "cuda_graph_impl", "none"),
        cuda_graph_scope=get(model, "cuda_graph_scope", None),
        use_megatron_fsdp=get(ddp, "use_megatron_fsdp", False) or get(dist, "use_megatron_fsdp", False),
        use_torch_fsdp2=get(dist, "use_torch_fsdp2", False),
        fp8_param_gather=get(ddp, "fp8_param_gather", False),
        fp4_param_gather=get(ddp, "fp4_param_gather", False),
        reuse_grad_buf_for_mxfp8_param_ag=get(ddp, "reuse_grad_buf_for_mxfp8_param_ag", False),
        use_precision_aware_optimizer=get(opt, "use_precision_aware_optimizer", False),
    )
    if world:
        args.world_size = world
        args.data_parallel_size = max(world // (tp * pp * cp), 1)
    return args


def check_checkpointing(cfg, config: LoCoConfig) -> None:
    """Refuse the checkpoint settings LoCo's state does not travel in, when LoCo saves state
    (``loco.bits`` 4/8 or ``loco.param_bits``) and the run saves or loads:

    * ``checkpoint.ckpt_format`` other than ``torch_dist`` (``fsdp_dtensor``: Megatron FSDP's
      format, whose optimizer state LoCo does not hook; ``torch``: not tested through Bridge);
    * ``checkpoint.non_persistent_ckpt_type="local"``: NVRx local checkpoints write the
      optimizer's state through nvidia-resiliency-ext's own manager, without LoCo's entry.

    Raises:
        LoCoConfigError: one line naming the setting and what to use instead.
    """
    if not (config.enabled or config.params_enabled):
        return
    ckpt = cfg.checkpoint
    loco = f"loco.bits={config.bits}" if config.enabled else f"loco.param_bits={config.param_bits}"
    saves = any(getattr(ckpt, name, None) for name in ("save", "load", "pretrained_checkpoint"))
    fmt = getattr(ckpt, "ckpt_format", "torch_dist")
    if saves and fmt not in SUPPORTED_FORMATS:
        raise LoCoConfigError(
            f"checkpoint.ckpt_format={fmt!r} cannot be used with {loco}: LoCo's error buffers "
            f"and step counters are saved and loaded through Bridge only in the 'torch_dist' "
            f"format; set checkpoint.ckpt_format='torch_dist' or drop {loco}.")
    if getattr(ckpt, "non_persistent_ckpt_type", None) == "local" and (
            getattr(ckpt, "non_persistent_save_interval", None) or saves):
        raise LoCoConfigError(
            f"checkpoint.non_persistent_ckpt_type='local' cannot be used with {loco}: NVRx local "
            f"checkpoints save the optimizer without LoCo's error buffers, so a resume from one "
            f"would not continue LoCo's run; use non_persistent_ckpt_type='global' (torch_dist) "
            f"or drop {loco}.")


def check(cfg, config: LoCoConfig, emulated: bool) -> None:
    """Every refusal before Bridge starts: the other launch paths' checks
    (:func:`loco_megatron.cli.preflight.check_megatron_args`), the checkpoint settings
    (:func:`check_checkpointing`) and, on CPU ranks, ``checkpoint.async_save``
    (:data:`loco_megatron.training.startup.ASYNC_SAVE_ON_CPU`).

    Raises:
        LoCoConfigError: the first refusal, in Bridge's words (:func:`in_bridge_words`).
    """
    from ..cli.preflight import check_megatron_args
    from ..training.startup import ASYNC_SAVE_ON_CPU

    try:
        if emulated and getattr(cfg.checkpoint, "async_save", False):
            raise LoCoConfigError(ASYNC_SAVE_ON_CPU)
        check_megatron_args(megatron_args(cfg), config)
        check_checkpointing(cfg, config)
    except LoCoConfigError as e:
        raise LoCoConfigError(in_bridge_words(str(e))) from None
