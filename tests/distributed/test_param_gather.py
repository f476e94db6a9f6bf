"""``--loco-param-bits``: the distributed optimizer's parameter all-gather as 4/8-bit weight
differences, inside megatron-core GPTModel + DDP + DistributedOptimizer on CPU ranks.

Every step: the model parameters are bit-identical across the DP replicas (their raw bytes
compared), TP-replicated parameters identical across TP ranks, ``|main - held|`` within half a
quantization step + half an ulp (ratio <= 1), the bytes sent equal the formula and what the
collectives were handed; unset or at 16 bits it is stock megatron-core bit for bit.
"""

import pytest
import torch

import loco_megatron
from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.megatron import compat, plugin

from .worker_param_gather import grid_worker


def _check_compressed(res, steps, world, overlap, bound_steps=None):
    """The assertions every compressed run shares."""
    assert all(res["identical"]), res["identical"]  # every step and after the final sync
    assert len(res["identical"]) == steps + 1
    assert res["tp_drift"] == 0.0
    drifts = res["drift"][:bound_steps]
    assert len(drifts) == min(steps, bound_steps or steps) and max(drifts) <= 1.0, drifts
    loco, stock = res["expected"]
    assert 0 < loco < 0.3 * stock
    # the first step also re-gathers `held` exactly (stock bytes), then only differences
    assert res["step_bytes"][0] == loco + stock
    assert res["step_bytes"][1:] == [loco] * (steps - 1)
    assert all(h * (world - 1) == loco for h in res["handed"][1:])  # what the all-gathers were handed
    sent, stock_total, exact, calls, _ = res["stats"]
    assert sent == stock + steps * loco
    # overlapped: the first forward's all-gather (megatron's own) is the exact one; not
    # overlapped, the exact one comes before the first difference, on top of stock's traffic
    assert stock_total == (steps + overlap) * stock
    assert exact == len(res["shards"])  # one exact all-gather per bucket, at the start


def _same(a, b):
    assert a["losses"] == b["losses"]
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_tp1_dp2_fp32_50_steps_and_off_is_stock(run_ranks):
    """Overlap off, fp32 parameters (LoCo's own fp32 main copy), 50 steps: replicas identical
    and the bound holds at every step (it does not accumulate); unset / 16 bits = stock."""
    steps = 50
    results = run_ranks(grid_worker, 2, 1, ("stock", "unset", "param16", "param4"), steps,
                        False, torch.float32)
    for res in results:
        _same(res["stock"], res["unset"])
        _same(res["stock"], res["param16"])
        p4 = res["param4"]
        _check_compressed(p4, steps, 2, False)
        assert p4["stats"][4] > 0  # fp32 main-parameter copies were made
        # the iteration line's figures: bytes per step and drift as recomputed in fp64
        loco, stock = p4["expected"]
        for step, (fig, (dmax, drms)) in enumerate(p4["figures"]):
            assert fig["bytes_per_step"] == (loco + stock if step == 0 else loco)
            assert fig["stock_bytes_per_step"] == stock
            assert fig["drift_max"] == pytest.approx(dmax, rel=1e-4, abs=1e-9)
            assert fig["drift_rms"] == pytest.approx(drms, rel=1e-3, abs=1e-9)
        assert 0 < p4["figures"][-1][1][0] < 0.05
        assert p4["losses"] != res["stock"]["losses"]  # it really compressed
        assert abs(p4["losses"][-1] - res["stock"]["losses"][-1]) < 0.01 * res["stock"]["losses"][0]


def test_tp1_dp2_bf16_overlapped_several_buckets(run_ranks):
    """Overlapped gradient reduce and parameter gather (several buckets, megatron's coalescing
    manager): the handle megatron waits on applies the differences."""
    steps = 12
    results = run_ranks(grid_worker, 2, 1, ("stock", "param16", "param4", "both4"), steps, True,
                        torch.bfloat16, {"bucket_size": 6000})
    for res in results:
        _same(res["stock"], res["param16"])
        for mode in ("param4", "both4"):
            assert res[mode]["buckets"] > 1
            _check_compressed(res[mode], steps, 2, True)
            assert res[mode]["stats"][4] == 0  # bf16: megatron's fp32 main copy is used
            assert abs(res[mode]["losses"][-1] - res["stock"]["losses"][-1]) < 0.01 * res[
                "stock"]["losses"][0]


def test_tp2_dp2_overlapped_bf16(run_ranks):
    """TP 2 x DP 2: DP replicas identical, TP-replicated parameters identical on both TP ranks
    (blocks cut at parameter boundaries)."""
    steps = 6
    for res in run_ranks(grid_worker, 4, 2, ("param4", "both4"), steps, True, torch.bfloat16):
        for mode in ("param4", "both4"):
            _check_compressed(res[mode], steps, 2, True)


def test_dp3_shards_not_multiples_of_the_block(run_ranks):
    """DP 3: shards are not whole blocks (padded chunks on the wire, equal all-gather sizes)."""
    steps = 6
    for res in run_ranks(grid_worker, 3, 1, ("param8", "param4"), steps, False, torch.float32):
        for mode in ("param8", "param4"):
            assert any(shard % block for shard, block in res[mode]["shards"])
            _check_compressed(res[mode], steps, 3, False)


@pytest.fixture
def _clean():
    loco_megatron.uninstall()
    module = compat.param_and_grad_buffer_module()
    saved = module.dist_all_gather_func
    yield module
    module.dist_all_gather_func = saved
    loco_megatron.uninstall()


def test_replaced_all_gather_refused_at_install(_clean):
    def mock_all_gather(*args, **kwargs):
        raise AssertionError("not to be called")

    _clean.dist_all_gather_func = mock_all_gather
    with pytest.raises(LoCoConfigError, match="mock_all_gather.*--loco-param-bits"):
        loco_megatron.install(LoCoConfig(param_bits=4))
    assert plugin.get_state() is None
    loco_megatron.install(LoCoConfig(bits=4))  # the gradient path alone does not need it


def test_refusals_name_the_flag():
    from types import SimpleNamespace

    from loco_megatron.megatron.param_sync import check_ddp_config

    base = dict(use_distributed_optimizer=True)
    for extra, what in ((dict(use_distributed_optimizer=False), "--use-distributed-optimizer"),
                        (dict(use_megatron_fsdp=True), "FSDP"),
                        (dict(fp8_param_gather=True), "--fp8-param-gather"),
                        (dict(reuse_grad_buf_for_mxfp8_param_ag=True), "mxfp8")):
        with pytest.raises(LoCoConfigError, match=f"--loco-param-bits.*{what}|{what}.*"):
            check_ddp_config(SimpleNamespace(**{**base, **extra}), 2)
        check_ddp_config(SimpleNamespace(**{**base, **extra}), 1)  # DP 1: nothing to refuse
    with pytest.raises(LoCoConfigError, match="--loco-param-bits 3"):
        LoCoConfig(param_bits=3)


def test_pipeline_pp2_dp2(run_ranks):
    """PP 2 x DP 2, 1F1B and interleaved (2 virtual chunks, one of them unbucketed): every
    stage's replicas identical every step, tied embeddings identical across the stages."""
    from .worker_pipeline import pipeline_worker

    steps, cases = 6, ((None, False), (2, True))
    for per_case in run_ranks(pipeline_worker, 4, cases, ("stock", "param4", "both4"), steps):
        for case, res in per_case.items():
            for mode in ("param4", "both4"):
                assert res[mode]["identical"] == [True] * steps, (case, mode)
                assert res[mode]["tied_drift"] == 0.0, (case, mode)
            if res["stock"]["stage"] == 1:  # losses on the last stage
                assert res["param4"]["losses"] != res["stock"]["losses"]
                assert abs(res["param4"]["losses"][-1] - res["stock"]["losses"][-1]) < 0.05


@pytest.mark.parametrize("world", [2, 4], ids=["EP2xDP1_experts", "EP2xDP2_experts"])
def test_moe_ep2(run_ranks, world):
    """MoE, EP 2 (overlapped gradient reduce): dense buckets over the DP group, expert buckets
    over the expert-DP group (size 1 with 2 ranks: megatron's own path, nothing sent)."""
    from .worker_param_gather import moe_worker

    steps = 4
    for res in run_ranks(moe_worker, world, steps):
        for mode in ("param4", "both4"):
            assert res[mode]["identical"] == [(True, True)] * steps, mode
            assert res[mode]["expert_buckets"] > 0
            expected = {world} | ({world // 2} if world // 2 > 1 else set())
            assert set(res[mode]["group_sizes"]) == expected, res[mode]["group_sizes"]
            assert abs(res[mode]["losses"][-1] - res["stock"]["losses"][-1]) < 0.05


@pytest.mark.parametrize("config", [dict(param_bits=4), dict(bits=4, param_bits=4)],
                         ids=["param4", "both4"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_bit_identical(run_ranks, tmp_path, config, dtype):
    """N steps, save (torch and torch_dist), new processes, load, N more: the losses and the
    final parameters equal 2N uninterrupted steps bit for bit (the fp32 main parameters come
    back from the optimizer state, ``held`` from the model's, and the replicas re-gather
    ``held`` exactly once before the next difference)."""
    import os

    from .worker_ckpt import ckpt_worker

    n, d = 3, str(tmp_path)
    cfg = dict(block_size=64, reset_interval=3, **config)
    ddp = {"params_dtype": torch.bfloat16} if dtype == "bf16" else {}
    formats = ["torch", "torch_dist"]
    saves = run_ranks(ckpt_worker, 2, 1, [
        {"phase": "straight", "config": cfg, "steps": 2 * n, "ddp": ddp},
        {"phase": "save", "config": cfg, "steps": n, "formats": formats, "dir": d, "ddp": ddp}])
    loads = run_ranks(ckpt_worker, 2, 1, [
        {"phase": "load", "config": cfg, "steps": n, "format": f, "dir": os.path.join(d, f),
         "ddp": ddp} for f in formats])
    for rank in range(2):
        straight, first = saves[rank]
        for i, fmt in enumerate(formats):
            second = loads[rank][i]
            assert "error" not in second, second.get("error")
            assert first["losses"] + second["losses"] == straight["losses"], fmt
            for name, p in straight["params"].items():
                assert torch.equal(p, second["params"][name]), (fmt, name)
            assert second["logs"] == [], second["logs"]


def test_full_resume_after_a_model_only_load_is_exact(run_ranks, tmp_path):
    """``--loco-param-bits 4``, fp32, ``torch_dist`` through the DDP model as Megatron-LM loads:
    a model-only load of the checkpoint, then the full resume in the same process, continue
    bit for bit as the uninterrupted run (the full load restores the main parameters in place;
    a snapshot left by the model-only load made the model load refresh them from ``held``)."""
    import os

    from .worker_ckpt import ckpt_worker

    n, d = 3, str(tmp_path)
    cfg = dict(block_size=64, param_bits=4)
    saves = run_ranks(ckpt_worker, 2, 1, [
        {"phase": "straight", "config": cfg, "steps": 2 * n},
        {"phase": "save", "config": cfg, "steps": n, "formats": ["torch_dist"], "dir": d}])
    loads = run_ranks(ckpt_worker, 2, 1, [
        {"phase": "load", "config": cfg, "steps": n, "format": "torch_dist", "via_ddp": True,
         "model_first": first, "dir": os.path.join(d, "torch_dist")} for first in (False, True)])
    for rank in range(2):
        straight, saved = saves[rank]
        for second in loads[rank]:
            assert "error" not in second, second.get("error")
            assert saved["losses"] + second["losses"] == straight["losses"]
            for name, p in straight["params"].items():
                assert torch.equal(p, second["params"][name]), name


def test_fp16_overflow_step_sends_nothing(run_ranks):
    """fp16 with the dynamic loss scaler: the step megatron skips on overflow has no new
    difference, so nothing is gathered; replicas stay identical throughout."""
    from .worker_loss_scale import INF_STEP
    from .worker_param_gather import fp16_worker

    for res in run_ranks(fp16_worker, 2):
        for mode, rows in res.items():
            assert [ok for ok, _, _ in rows] == [i != INF_STEP for i in range(len(rows))], mode
            assert rows[INF_STEP][1] == 0 and all(b > 0 for ok, b, _ in rows if ok), rows
            assert all(same for _, _, same in rows), mode


@pytest.mark.parametrize("hook", ["model_load", "double_step"])
def test_overlapped_differences_survive_a_reload_or_a_second_step(run_ranks, hook):
    """With --overlap-param-gather the differences wait for the next forward. An in-process
    model load in between (model.load_state_dict + reload_model_params) must not leave the
    replicas apart (every rank, the owner too, applies the pending difference to what it
    loaded), and a second optimizer step first sends the pending one (no error)."""
    from .worker_param_gather import reload_worker

    for res in run_ranks(reload_worker, 2, hook):
        assert all(res["stock"]) and all(res["param4"]), res
        assert len(res["param4"]) == 6


def test_startup_warns_when_differences_outweigh_the_parameters(capsys):
    """Every block sends a 4-byte scale: 2-element blocks of 8-bit differences of bf16
    parameters (2 bytes of codes + 4 of scale per 4 bytes stock) send more than stock; the
    start-up line says so and names --loco-block-size. A huge block costs nothing extra."""
    from loco_megatron.layout import BucketLayout
    from loco_megatron.megatron.report import log_param_gather

    cfg = LoCoConfig(param_bits=8, block_size=2)
    log_param_gather(0, cfg, [(BucketLayout.build(4096, 2, 2, (100, 1000)), 2)])
    out = capsys.readouterr().out
    assert "LoCo WARNING: the parameter all-gather sends" in out and "--loco-block-size 2" in out
    log_param_gather(0, LoCoConfig(param_bits=4, block_size=65536),
                     [(BucketLayout.build(4096, 2, 65536, (100, 1000)), 2)])
    assert "WARNING" not in capsys.readouterr().out
    log_param_gather(0, LoCoConfig(param_bits=4), [(BucketLayout.build(4096, 2, 256), 2)])
    assert "WARNING" not in capsys.readouterr().out


@pytest.mark.parametrize("dtype,reload,via", [
    ("fp32", True, "state_dict"), ("fp32", False, "state_dict"), ("bf16", True, "state_dict"),
    ("bf16", False, "state_dict"), ("fp32", False, "dist_checkpointing")])
def test_in_process_model_load_keeps_the_loaded_weights(run_ranks, tmp_path, dtype, reload, via):
    """``model.load_state_dict`` of the step-0 state after 3 steps, with or without
    ``optimizer.reload_model_params()``: after the next all-gather every parameter is the loaded
    one on every replica, and one more step moves it one Adam step from there, as stock
    megatron-core (always given ``reload_model_params``) does: per tensor, at most half the
    distance the 3 training steps covered (plus one ulp of the parameter dtype). Before, fp32
    main copies kept the trained values and that step jumped back past them.
    ``dist_checkpointing``: the ``torch_dist`` format's load, which writes the model's tensors
    in place before ``model.load_state_dict`` sees them (a load told apart by comparing with the
    tensors as they were then missed every parameter)."""
    from .worker_param_loads import model_load_worker

    eps = torch.finfo(torch.bfloat16 if dtype == "bf16" else torch.float32).eps
    dist_dir = str(tmp_path) if via == "dist_checkpointing" else None
    for res in run_ranks(model_load_worker, 2, dtype, reload, dist_dir):
        for mode in ("stock", "param4"):
            run = res[mode]
            assert run["loaded_kept"] and all(run["identical"]), (mode, run["identical"])
            for name, after in run["after"].items():
                loaded, trained = run["loaded"][name], run["trained"][name]
                moved = (after - loaded).abs() - eps * after.abs()
                span = float((trained - loaded).abs().max())
                assert float(moved.max()) <= 0.5 * span, (mode, name, float(moved.max()), span)


def test_partial_model_load_keeps_the_pending_step(run_ranks):
    """A partial in-process load (one tensor, ``strict=False``) between the optimizer step and
    its overlapped all-gather: the loaded tensor is kept and every other parameter still gets
    that step, as in stock (which all-gathers the stepped shards): each moves by step 3 within
    a quarter of stock's move plus the weight difference's quantization. Before, the pending
    difference was dropped and the main parameters of the whole bucket reset to the pre-step
    values: the step was lost."""
    from .worker_param_loads import partial_load_worker

    for res in run_ranks(partial_load_worker, 2):
        for mode in ("stock", "param4"):
            assert res[mode]["kept"] and res[mode]["identical"], (mode, res[mode])
        for name, stock_moved in res["stock"]["moved"].items():
            ours = res["param4"]["moved"][name]
            assert abs(ours - stock_moved) <= 0.25 * stock_moved + 1e-6, (name, ours, stock_moved)
