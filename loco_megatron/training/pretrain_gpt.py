"""GPT pretraining with LoCo through Megatron's own training loop (``megatron.training``).

The role of Megatron-LM's ``pretrain_gpt.py``, written for this package (docs/architecture.md): a model
provider, a forward step and a dataset provider, handed to ``megatron.training.pretrain`` of the
installed megatron-core (>= 0.17 wheels ship ``megatron.training``). Every Megatron-LM flag works
(``--save``, ``--load``, ``--data-path``, ``--tensorboard-dir``, ...), plus the ``--loco-*``
flags and ``--config FILE.yaml`` (docs/configs.md). On a machine without a GPU it runs on CPU ranks through the CUDA emulation (gloo).

Run with ``python -m torch.distributed.run --nproc-per-node N -m loco_megatron.training.pretrain_gpt
<megatron flags>`` (``run_pretrain.sh`` does this with sensible defaults).
"""

import logging
import os
import warnings
from functools import partial

import torch

logger = logging.getLogger(__name__)
_BATCH_KEYS = {torch.int64: ("tokens", "labels", "position_ids"), torch.float32: ("loss_mask",),
               torch.bool: ("attention_mask",)}


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    """Build a megatron-core ``GPTModel`` from the parsed Megatron arguments.

    Transformer Engine layers with ``--transformer-impl transformer_engine`` (GPU), megatron-core's
    local layers otherwise; MoE block spec when ``--num-experts`` is set (as Megatron-LM's
    gpt_builders.py does).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    print_rank_0("building GPT model ...")
    config = config or core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                vp_stage=vp_stage)
    elif use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)
    else:
        spec = specs.get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm,
                                              args.qk_layernorm, normalization=args.normalization)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection)


def get_batch(data_iterator):
    """Next micro-batch on TP rank 0, broadcast to the other TP ranks.

    Returns ``(tokens, labels, loss_mask, attention_mask, position_ids)``: int64 ``[b, s]``,
    int64 ``[b, s]``, fp32 ``[b, s]``, bool ``[b, 1, s, s]`` or None, int64 ``[b, s]``; all None on
    pipeline stages that are neither first nor last.
    """
    from megatron.core import mpu, tensor_parallel

    if not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()):
        return None, None, None, None, None
    data = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else None
    has_mask = torch.tensor([int(data is not None and "attention_mask" in data)],
                            device=torch.cuda.current_device())  # NCCL needs a device tensor
    torch.distributed.broadcast(has_mask, mpu.get_tensor_model_parallel_src_rank(),
                                group=mpu.get_tensor_model_parallel_group())
    batch = {}
    for dtype, keys in _BATCH_KEYS.items():
        keys = [k for k in keys if k != "attention_mask" or has_mask.item()]
        if keys:
            sent = {k: data[k].to(dtype) for k in keys} if data is not None else None
            batch.update(tensor_parallel.broadcast_data(keys, sent, dtype))
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token-summed LM loss, the token count and the ``lm loss`` report (megatron >= 0.12
    convention: the training loop divides by the global token count)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                     num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One forward pass; returns the output tensor and the loss function to apply to it."""
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT datasets from ``--data-path`` (Megatron indexed datasets) or ``--mock-data``, built by
    megatron-core's ``BlendedMegatronDatasetBuilder``."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mmap_bin_files=args.mmap_bin_files)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")

    def is_built_on_rank():
        return mpu.get_tensor_model_parallel_rank() == 0 and (
            mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage())

    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, is_built_on_rank, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True


def main() -> None:
    """Parse Megatron + LoCo flags, install LoCo, run ``megatron.training.pretrain``.

    The LoCo steps are :mod:`loco_megatron.training.startup`'s, shared with the wrapper around
    a Megatron-LM checkout (:mod:`loco_megatron.training.run_megatron_lm`).
    """
    from ..megatron import compat
    from . import startup

    try:
        compat.require_megatron_training()  # megatron-core < 0.17: needs a Megatron-LM checkout
    except RuntimeError as e:
        startup.fail(e)

    # the main job's data and tokenizer are local files: never ask the Hugging Face Hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    emulated = startup.prepare(main_job=True)  # also expands --config FILE in sys.argv

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=startup.extra_args_provider)
    startup.install_from_args(args, emulated)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*recommended to use a ModelConfig.*")
        cfg = pretrain_cfg_container_from_args(args, None)
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)


if __name__ == "__main__":
    main()
