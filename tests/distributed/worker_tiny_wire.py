"""The issue's tiny model on 3 DP ranks (1 layer, hidden 8, vocab 61): what the start-up line
promises against what the all-to-alls are handed, and the error state, per block size."""

import contextlib
import io
import re

import torch
import torch.distributed as dist

VOCAB, SEQ, HIDDEN = 61, 16, 8


def _build():
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3,
                                                 use_distributed_optimizer=True), [model])
    return model, opt


def _step(model, opt):
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(7 + ps.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    position = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(tokens, position, mask, labels=tokens).mean()
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    return float(loss)


def tiny_wire_worker(rank, world, blocks):
    """Per block size: the chunk line's bytes and stock bytes, the bytes handed to the
    all-to-alls in one step (what leaves this rank: each call's input minus its own chunk),
    the error state's bytes and the gradient elements, two losses."""
    import loco_megatron
    from loco_megatron.emulation import activate
    from megatron.core import parallel_state as ps

    activate()
    ps.initialize_model_parallel()
    out = {}
    real = dist.all_to_all_single
    handed = []

    def counting(output, input, *args, **kwargs):
        handed.append(input.numel() * input.element_size() * (world - 1) // world)
        return real(output, input, *args, **kwargs)

    for block in blocks:
        state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=block))
        text = io.StringIO()
        dist.all_to_all_single = counting
        try:
            with contextlib.redirect_stdout(text):
                model, opt = _build()
            handed.clear()
            losses = [_step(model, opt)]
            step_bytes = sum(handed)
            losses.append(_step(model, opt))
            # the chunk's totals line, printed on rank 0 (equal splits: every rank sends as much)
            line = next((x for x in text.getvalue().splitlines()
                         if re.search(r"model chunk 0: \d+ buckets", x)), None)
            loco = stock = None
            if line is not None:
                loco, stock = map(int, re.search(r"(\d+) bytes/step per rank on the wire vs "
                                                 r"(\d+) stock", line).groups())
            out[block] = {"line": line, "loco": loco, "stock": stock, "handed": step_bytes,
                          "wire": state.wire.bytes_sent // 2, "losses": losses,
                          "error_bytes": state.compensator.error_bytes(),
                          "elements": sum(b.grad_data.numel() for buf in model.buffers
                                          for b in buf.buckets)}
        finally:
            dist.all_to_all_single = real
            loco_megatron.uninstall()
    return out


def full_precision_1d_worker(rank, world):
    """One step of the tiny GPT, stock and with ``--loco-bits 4 --loco-full-precision-1d``:
    this rank's reduced gradient shard of every bucket, the 1-D parameters' ranges in it, the
    start-up line's bytes and what the all-to-alls were handed (codes and scales, and the
    fp32 lane: each call's input minus its own chunk)."""
    import loco_megatron
    from loco_megatron.emulation import activate
    from megatron.core import parallel_state as ps

    activate()
    ps.initialize_model_parallel()
    real_a2a = dist.all_to_all_single
    handed = []  # per all-to-all: (dtype, bytes sent to the other ranks)

    def a2a(output, input, *args, **kwargs):
        handed.append((str(input.dtype), input.numel() * input.element_size() * (world - 1)
                       // world))
        return real_a2a(output, input, *args, **kwargs)

    out = {}
    for mode in ("stock", "fp1d"):
        state = None
        if mode == "fp1d":
            state = loco_megatron.install(loco_megatron.LoCoConfig(
                bits=4, block_size=16, full_precision_1d=True))
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                model, opt = _build()
            if mode == "fp1d":
                dist.all_to_all_single = a2a
            _step(model, opt)
            dist.all_to_all_single = real_a2a
            shards, one_d = [], []
            for buf in model.buffers:
                for bucket in buf.buckets:
                    shard = bucket.grad_data.numel() // world
                    shards.append(bucket.grad_data[rank * shard:(rank + 1) * shard].clone())
                    idx = {p: buf.param_index_map[p] for p in bucket.params}
                    one_d.append(sorted((s - bucket.offset - rank * shard,
                                         e - bucket.offset - rank * shard)
                                        for p, (s, e, _) in idx.items() if p.dim() == 1))
            res = {"shards": shards, "one_d": one_d}
            if state is not None:
                line = next((x for x in text.getvalue().splitlines()
                             if re.search(r"model chunk 0: \d+ buckets", x)), None)
                res.update(line=line, wire=state.wire.bytes_sent, handed=list(handed),
                           buffer_lines=[x for x in text.getvalue().splitlines()
                                         if "gradient buffer" in x])
                if line is not None:
                    res["loco"], res["stock"] = map(int, re.search(
                        r"(\d+) bytes/step per rank on the wire vs (\d+) stock", line).groups())
            out[mode] = res
        finally:
            dist.all_to_all_single = real_a2a
            if state is not None:
                loco_megatron.uninstall()
    return out
