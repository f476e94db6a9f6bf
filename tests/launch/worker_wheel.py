"""Rank side of the installed-wheel smoke test (tests/launch/test_wheel_install.py).

Run by ``torch.distributed.run`` as a plain script from a directory outside the repository,
with only the installed wheel (``pip install --target``) and the venv's torch and megatron-core
importable: it must not import anything from the source tree (no ``tests.*``).

Per rank: CPU emulation and gloo, a tiny megatron-core GPT with DDP and the distributed
optimizer, LoCo 4-bit installed with ``--loco-kernels auto`` and then ``cpu``; a few compressed
steps each; a checkpoint round trip (megatron-core's torch-format optimizer calls) into a
freshly built model (a resumed job), which must restore the parameters and LoCo's error
buffers exactly and train on.
Prints ``WHEEL SMOKE OK`` per rank and where ``loco_megatron`` was imported from.
"""

import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, HIDDEN, STEPS = 128, 32, 64, 3


def build():
    """A seeded 2-layer GPT in megatron-core DDP with its distributed Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                            use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                        grad_reduce_in_fp32=True, bucket_size=20000)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp, module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3,
                                                 use_distributed_optimizer=True), [model])
    return model, opt


def step(model, opt) -> float:
    """Forward, backward, the (compressed) reduce-scatter and the optimizer step."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    position = torch.arange(SEQ).unsqueeze(0).expand(4, -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(tokens, position, mask, labels=tokens).mean()
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    return float(loss)


def errors(state):
    """Every bucket's stored error tensors (copies)."""
    return {key: {k: t.clone() for k, t in buf.tensors().items()}
            for key, buf in state.compensator.errors.items()}


def run(kernels_choice: str, ckpt: str) -> None:
    """Train ``STEPS`` compressed steps, save, load into a fresh model, compare."""
    import loco_megatron
    from loco_megatron import kernels
    from loco_megatron.megatron import compat

    impl = kernels.select(kernels_choice, torch.zeros(4))
    assert impl == "cpu", f"--loco-kernels {kernels_choice} resolved to {impl}, not the C kernels"
    config = loco_megatron.LoCoConfig(bits=4, kernels=kernels_choice)
    param_state = os.path.join(ckpt, "distrib_optim.pt")
    with loco_megatron.installed(config) as state:
        model, opt = build()
        losses = [step(model, opt) for _ in range(STEPS)]
        sent, stock = state.wire.bytes_sent, state.wire.stock_bytes
        assert 0 < sent < stock, (sent, stock)
        saved_errors = errors(state)
        assert saved_errors, "no error buffers after compressed steps"
        os.makedirs(ckpt, exist_ok=True)
        opt.save_parameter_state(param_state)
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(ckpt, "model_optim.pt"))
        dist.barrier()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with loco_megatron.installed(config) as state:  # a resumed job: a fresh model, then load
        model, opt = build()
        with torch.no_grad():  # as megatron.training loads
            compat.init_optimizer_states_for_load(opt)
            common = torch.load(os.path.join(ckpt, "model_optim.pt"), weights_only=False)
            model.load_state_dict(common["model"])
            opt.load_state_dict(common["optimizer"])
            opt.load_parameter_state(param_state)
        for name, p in model.named_parameters():
            assert torch.equal(p, params[name]), f"parameter {name} differs after the load"
        loaded = errors(state)
        assert loaded.keys() == saved_errors.keys()
        for key, tensors in saved_errors.items():
            for k, t in tensors.items():
                assert torch.equal(loaded[key][k], t), f"error buffer {key} {k} differs"
        after = step(model, opt)
    print(f"WHEEL SMOKE OK rank {dist.get_rank()} kernels {kernels_choice}: losses "
          f"{[round(x, 4) for x in losses]} then {after:.4f} after the load, {sent} bytes "
          f"vs {stock} stock", flush=True)


def main() -> None:
    """Both kernel choices, one checkpoint directory each (``argv[1]``: where to write)."""
    dist.init_process_group("gloo")
    from loco_megatron.emulation import activate

    activate()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    # megatron-core's torch-AdamW resume defect without TE/apex (docs/compatibility.md), fixed
    # as the launch paths do (loco_megatron.training.workarounds)
    from loco_megatron.training.workarounds import fix_torch_adamw_resume

    fix_torch_adamw_resume()
    import loco_megatron

    if dist.get_rank() == 0:
        print(f"loco_megatron imported from {os.path.dirname(loco_megatron.__file__)}",
              flush=True)
    for choice in ("auto", "cpu"):
        run(choice, os.path.join(sys.argv[1], choice))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
