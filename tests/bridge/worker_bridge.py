"""Rank side of the Megatron-Bridge tests: a tiny GPT recipe trained by Bridge's own
``pretrain`` (megatron/bridge/training/pretrain.py) on CPU ranks (gloo, the CUDA emulation).

``run(rank, world, spec)`` trains once and returns, per rank, the losses Bridge reported at each
iteration, a copy of the final model parameters, LoCo's counters, what :class:`LoCoCallback`
wrote, and rank 0's printed start-up lines. ``spec`` (a dict) says how:

* ``path``: ``"loco"`` (:func:`loco_megatron.bridge.pretrain`, ``loco`` = ``spec["loco"]``) or
  ``"stock"`` (Bridge's ``pretrain`` called directly, without the package's install: only the
  CPU emulation and the Bridge workarounds a CPU machine needs);
* ``iters``, ``save``, ``save_interval``, ``load``, ``ckpt_step``, ``log_interval``, ``tb``;
* ``drop_loco_state``: a resume that ignores the checkpoint's LoCo entries (the round trip
  must then differ: the test's failure demonstration).
"""

import contextlib
import io
import logging

import torch

SEQ, VOCAB = 32, 128


def recipe(spec: dict):
    """The tiny recipe: a Bridge ``ConfigContainer`` (GPT 2 layers x hidden 64, mock data,
    fp32, distributed optimizer, torch_dist checkpoints)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig,
        LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig,
        TokenizerConfig, TrainingConfig, ValidationConfig)

    model = GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=VOCAB,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=False, params_dtype=torch.float32,
        transformer_layer_spec=local_layer_spec, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False)
    iters = spec.get("iters", 4)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=iters, global_batch_size=4,
                             micro_batch_size=spec.get("mbs", 2)),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-3, weight_decay=0.01,
                                  clip_grad=1.0, bf16=False, fp16=False,
                                  params_dtype=torch.float32, use_distributed_optimizer=True),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0,
                                  lr_decay_iters=100, start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                          overlap_grad_reduce=False, bucket_size=20000),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False,
                                     num_dataset_builder_threads=1, split="1,1,1",
                                     dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=spec.get("log_interval", 1),
                            tensorboard_dir=spec.get("tb")),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        checkpoint=CheckpointConfig(save=spec.get("save"), load=spec.get("load"),
                                    save_interval=spec.get("save_interval"),
                                    ckpt_step=spec.get("ckpt_step"), ckpt_format="torch_dist"),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        mixed_precision=None,
    )


def _recorder(out: dict):
    from megatron.bridge.training.callbacks import Callback

    class Recorder(Callback):
        """Bridge's reported loss per iteration and the final parameters (every rank)."""

        def on_train_step_end(self, context):
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            out["losses"].append(None if loss is None else float(loss))

        def on_train_end(self, context):
            from loco_megatron.megatron import plugin

            out["params"] = {n: p.detach().clone() for n, p in
                             context.model[0].module.named_parameters()}
            state = plugin.get_state()
            if state is not None:
                out["wire"] = (state.wire.bytes_sent, state.wire.stock_bytes)
                if state.param_sync is not None:
                    out["param_wire"] = (state.param_sync.stats.bytes_sent,
                                         state.param_sync.stats.stock_bytes)

    return Recorder()


@contextlib.contextmanager
def _without_loco_entries():
    """Resume as if the checkpoint held no LoCo state: its error buffers and counters are not
    applied (loco_megatron/megatron/checkpoint/dist_format.py ``load_entry``)."""
    from loco_megatron.megatron.checkpoint import dist_format

    saved = dist_format.load_entry
    dist_format.load_entry = lambda view, entry: None
    try:
        yield
    finally:
        dist_format.load_entry = saved


def run(rank, world, spec):
    """Train once as ``spec`` says (module docstring); returns this rank's record."""
    from megatron.bridge.training.gpt_step import forward_step

    out = {"losses": [], "logs": []}
    cfg = recipe(spec)
    callbacks = [_recorder(out)]
    printed = io.StringIO()
    handler = logging.Handler(logging.INFO)  # LoCo's checkpoint notes (logging, not print)
    handler.emit = lambda record: out["logs"].append(record.getMessage())
    logging.getLogger("loco_megatron").addHandler(handler)
    with contextlib.redirect_stdout(printed):
        if spec.get("path", "loco") == "stock":
            from loco_megatron.bridge import workarounds
            from loco_megatron.emulation import activate
            from megatron.bridge.training.pretrain import pretrain

            activate()
            workarounds.apply_needed(emulated=True)
            pretrain(cfg, forward_step, callbacks=callbacks)
        else:
            from loco_megatron.bridge import LoCoCallback, pretrain

            loco_cb = LoCoCallback()  # passed in: pretrain uses it, and its history is read
            callbacks.append(loco_cb)
            guard = _without_loco_entries() if spec.get("drop_loco_state") else \
                contextlib.nullcontext()
            with guard:
                pretrain(cfg, forward_step, callbacks=callbacks, loco=spec.get("loco"))
            out["figures"] = loco_cb.history
    logging.getLogger("loco_megatron").removeHandler(handler)
    out["printed"] = printed.getvalue() if rank == 0 else ""
    return out
