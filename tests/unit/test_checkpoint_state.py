"""The one LoCo checkpoint state shape and resume policy, single process
(loco_megatron/megatron/checkpoint/state.py: ``OptimizerLoCo.state_dict`` / ``load_state_dict``,
which the torch and torch_dist hooks serialise): exact resume, the documented resets, clear
errors on corrupted entries, and the Compensator's step-counter API. The multi-rank paths
(DP-size changes through the summed form, both formats on disk) are in the distributed tests
(test_checkpoint.py)."""

import io
from types import SimpleNamespace

import pytest
import torch

from loco_megatron.config import CONVERT, GRIDS, RESET, LoCoConfig, fingerprint, fingerprint_fields
from loco_megatron.megatron.checkpoint.state import LEGACY_FINGERPRINT, OptimizerLoCo, saved_setting
from loco_megatron.megatron.plugin import LoCoState

BLOCK = 64
DP = 2  # the view's DP size (nothing is sent, so no process group is needed for "exact")


class _Group:
    def rank(self):
        return 0

    def size(self):
        return DP


def _view(config, numels=(BLOCK * 4, BLOCK * 2)):
    """An ``OptimizerLoCo`` over a stand-in DistributedOptimizer with one gradient buffer of
    ``len(numels)`` buckets (one parameter each), registered as megatron's DDP would."""
    state = LoCoState(config)
    buckets = []
    for b, numel in enumerate(numels):
        buckets.append(SimpleNamespace(grad_data=torch.zeros(numel), bucket_id=b,
                                       loco_key=(0, 0, b), loco_param_ranges={b: (0, numel)},
                                       loco_generation=state.generation))
    optimizer = SimpleNamespace(data_parallel_group=_Group(),
                                buffers=[SimpleNamespace(params=[], buckets=buckets)])
    return OptimizerLoCo(optimizer, state)


def _train(view, steps):
    """Compress every bucket for ``steps`` (seeded gradients); returns the payloads."""
    comp, out = view.state.compensator, []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        for ref in view.buckets:
            grad = torch.randn(ref.bucket.grad_data.numel(), generator=g)
            out.append(comp.compress(ref.key, grad, ref.layout))
    return out


def _saved(view):
    state = view.state_dict(forms=["exact"])
    buf = io.BytesIO()
    torch.save(state, buf)  # as plain as the torch format's file
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("error_dtype", ["int8", "fp32"])
def test_resume_is_bit_identical(error_dtype):
    cfg = LoCoConfig(bits=4, block_size=BLOCK, reset_interval=5, error_dtype=error_dtype)
    straight = _view(cfg)
    ref = _train(straight, range(8))
    first = _view(cfg)
    _train(first, range(4))
    resumed = _view(cfg)
    assert resumed.load_state_dict(_saved(first), "ckpt") == []
    out = _train(resumed, range(4, 8))
    for (p1, s1), (p2, s2) in zip(ref[8:], out):  # resets at step 5 happen in both runs
        assert torch.equal(p1, p2) and torch.equal(s1, s2)
    assert resumed.state.compensator.stats.steps == straight.state.compensator.stats.steps


def test_changed_bits_or_block_resets_with_warning():
    view = _view(LoCoConfig(bits=4, block_size=BLOCK))
    _train(view, range(2))
    other = _view(LoCoConfig(bits=8, block_size=BLOCK))
    notes = other.load_state_dict(_saved(view), "ckpt")
    assert len(notes) == 1 and "bits changed 4 -> 8" in notes[0] and "reset" in notes[0]
    assert not other.state.compensator.errors
    assert other.state.compensator.stats.steps == view.state.compensator.stats.steps


def test_changed_grid_resets_with_warning():
    """--loco-grid is a RESET setting: errors of one grid are not carried to the other."""
    view = _view(LoCoConfig(bits=4, block_size=BLOCK))
    _train(view, range(2))
    other = _view(LoCoConfig(bits=4, block_size=BLOCK, grid="full-range"))
    notes = other.load_state_dict(_saved(view), "ckpt")
    assert notes == ["LoCo: grid changed symmetric -> full-range since ckpt; error buffers reset "
                     "to zero"]
    assert not other.state.compensator.errors
    assert other.state.compensator.stats.steps == view.state.compensator.stats.steps


@pytest.mark.parametrize("grid", GRIDS)
def test_checkpoint_saved_before_the_grid_setting_counts_as_symmetric(grid):
    """A fingerprint without ``grid`` (saved before --loco-grid existed) was saved on the
    symmetric grid (LEGACY_FINGERPRINT): resumed bit for bit under symmetric, reset with the
    warning under full-range."""
    assert LEGACY_FINGERPRINT["grid"] == "symmetric" == LoCoConfig().grid
    view = _view(LoCoConfig(bits=4, block_size=BLOCK))
    _train(view, range(2))
    state = _saved(view)
    del state["meta"]["fingerprint"]["grid"]
    resumed = _view(LoCoConfig(bits=4, block_size=BLOCK, grid=grid))
    notes = resumed.load_state_dict(state, "ckpt")
    errors, saved = resumed.state.compensator.errors, view.state.compensator.errors
    if grid == "symmetric":
        assert notes == []
        assert errors.keys() == saved.keys() and errors
        for key, buf in saved.items():
            assert torch.equal(errors[key].codes, buf.codes)
            assert torch.equal(errors[key].scales, buf.scales)
    else:
        assert notes == ["LoCo: grid changed symmetric -> full-range since ckpt; error buffers "
                         "reset to zero"]
        assert not errors
    assert resumed.state.compensator.stats.steps == view.state.compensator.stats.steps


def test_legacy_fingerprint_covers_every_later_setting():
    """RESET/CONVERT settings added to the fingerprint after format version 1 was first written
    need a legacy value (else old checkpoints would read them as None: a spurious reset or
    conversion); the first checkpoints recorded bits, block_size and error_dtype."""
    effective = set(fingerprint_fields(RESET) + fingerprint_fields(CONVERT))
    assert effective - {"bits", "block_size", "error_dtype"} <= set(LEGACY_FINGERPRINT)
    assert set(LEGACY_FINGERPRINT) <= set(fingerprint(LoCoConfig()))
    assert saved_setting({}, "grid") == "symmetric"
    assert saved_setting({"grid": "full-range"}, "grid") == "full-range"
    assert saved_setting({}, "bits") is None  # no legacy value: a missing key stays missing


def test_changed_bucket_resets_that_bucket_only():
    view = _view(LoCoConfig(bits=4, block_size=BLOCK))
    _train(view, range(2))
    fresh = _view(LoCoConfig(bits=4, block_size=BLOCK), numels=(BLOCK * 3, BLOCK * 2))
    notes = fresh.load_state_dict(_saved(view), "ckpt")
    assert len(notes) == 1 and "gbuf_idx_0.bucket_idx_0" in notes[0]
    assert "parameters differ" in notes[0] and "bucket_idx_1" not in notes[0]
    errors = fresh.state.compensator.errors
    assert (0, 0, 0) not in errors
    assert torch.equal(errors[(0, 0, 1)].codes, view.state.compensator.errors[(0, 0, 1)].codes)


@pytest.mark.parametrize("corrupt,message", [
    (lambda e: e.pop("codes"), "expected fields"),
    (lambda e: e.update(codes=e["codes"][:-1]), "codes: expected 256 elements"),
    (lambda e: e.update(scales=e["scales"].double()), "scales: expected 4 elements of torch.float32"),
])
def test_corrupted_entry_is_a_clear_error(corrupt, message):
    view = _view(LoCoConfig(bits=4, block_size=BLOCK))
    _train(view, range(1))
    state = _saved(view)
    corrupt(state["exact"]["gbuf_idx_0.bucket_idx_0"])
    with pytest.raises(ValueError, match=r"ckpt key loco\.dp_group_idx_0\.gbuf_idx_0\.bucket_idx_0"):
        try:
            _view(LoCoConfig(bits=4, block_size=BLOCK)).load_state_dict(state, "ckpt")
        except ValueError as e:
            assert message in str(e)
            raise


def test_step_counter_api():
    view = _view(LoCoConfig(bits=4, block_size=BLOCK, reset_interval=3))
    comp = view.state.compensator
    key = view.buckets[0].key
    assert comp.step_of(key) == 0
    comp.count_step(key)  # a warm-up step at full precision counts
    _train(view, range(1))
    assert comp.step_of(key) == 2 and comp.stats.resets == 0
    comp.set_step(key, 3)  # a restored counter: the next compress is a reset step
    _train(view, range(1))
    assert comp.step_of(key) == 4 and comp.stats.resets == 1
    assert view.meta()["buckets"]["gbuf_idx_0.bucket_idx_0"]["step"] == 4


def test_more_buckets_after_resume_all_continue_the_step_count():
    """Another --ddp-bucket-size: a bucket the checkpoint does not have continues the
    optimizer step like the others (outside a load round too), not from 0."""
    view = _view(LoCoConfig(bits=4, block_size=BLOCK))
    _train(view, range(3))
    fresh = _view(LoCoConfig(bits=4, block_size=BLOCK), numels=(BLOCK * 4, BLOCK, BLOCK, BLOCK))
    notes = fresh.load_state_dict(_saved(view), "ckpt")
    assert len(notes) == 1 and "not in the checkpoint" in notes[0]
    assert set(fresh.state.compensator.stats.steps.values()) == {3}
    assert len(fresh.state.compensator.stats.steps) == 4


def test_which_checkpoint_holds_loco_state(tmp_path):
    """The launch paths install LoCo off when ``--load`` may resume LoCo state: the iteration
    the tracker names, ``--ckpt-step`` instead when given, or the non-persistent global
    checkpoint's tracker (megatron/training/checkpointing.py layout)."""
    from loco_megatron.megatron.checkpoint.hooks import checkpoint_holds_loco_state

    load = tmp_path / "ckpt"
    (load / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (load / "iter_0000002" / "mp_rank_00" / "loco_state_0_dp000.pt").write_bytes(b"x")
    (load / "iter_0000004" / "mp_rank_00").mkdir(parents=True)
    (load / "latest_checkpointed_iteration.txt").write_text("4")
    assert not checkpoint_holds_loco_state(str(load))
    assert checkpoint_holds_loco_state(str(load), ckpt_step=2)
    assert not checkpoint_holds_loco_state(str(load), ckpt_step=4)
    (load / "latest_checkpointed_iteration.txt").write_text("2")
    assert checkpoint_holds_loco_state(str(load))
    (load / "latest_checkpointed_iteration.txt").write_text("4")
    other = tmp_path / "np"
    (other / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (other / "iter_0000005" / "mp_rank_00" / "loco_state_0_dp001.pt").write_bytes(b"x")
    (other / "latest_checkpointed_iteration.txt").write_text("5")
    assert checkpoint_holds_loco_state(str(load), non_persistent_dir=str(other))
    assert not checkpoint_holds_loco_state(None) and not checkpoint_holds_loco_state(
        str(tmp_path / "missing"))


def _per_element_division_int8(e: torch.Tensor):
    """The int8 error storage as the quantizer wrote it before it multiplied by a reciprocal
    scale: ``scale = absmax / 127`` (subnormal scales allowed), ``codes = round(e / scale)``,
    one IEEE division per element."""
    blocks = e.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / torch.full((), 127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe.unsqueeze(1)).clamp_(-128, 127).to(torch.int8)
    return codes.view(-1), scales


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_checkpoint_from_the_per_element_division_quantizer_resumes(kernels):
    """An error buffer saved by the quantizer of before (codes of ``e / scale``, subnormal
    scales) loads as it was saved and decodes to the same error, bit for bit (the storage is
    ``codes * scale`` either way), and training resumes from it: every implementation's next
    compress equals the reference's from that state (the moving average absorbs the one-ulp
    difference of the new rounding)."""
    cfg = LoCoConfig(bits=4, block_size=BLOCK, kernels=kernels)
    view = _view(cfg)
    _train(view, range(2))
    state = _saved(view)
    gen = torch.Generator().manual_seed(7)
    old = {}
    for name, entry in state["exact"].items():
        e = torch.randn(entry["codes"].numel(), generator=gen) * 1e-3
        e[:BLOCK] *= 1e-36  # a block of subnormal errors: a subnormal scale, as saved then
        entry["codes"], entry["scales"] = _per_element_division_int8(e)
        old[name] = (entry["codes"].clone(), entry["scales"].clone())
    assert any((s[s > 0] < torch.finfo(torch.float32).tiny).any() for _, s in old.values())
    resumed, reference = _view(cfg), _view(LoCoConfig(bits=4, block_size=BLOCK, kernels="torch"))
    for target in (resumed, reference):
        assert target.load_state_dict(state, "ckpt") == []
    for ref in resumed.buckets:
        buf = resumed.state.compensator.errors[ref.key]
        codes, scales = old[ref.name]
        assert torch.equal(buf.codes, codes) and torch.equal(buf.scales, scales)
        decoded = (codes.float().view(-1, BLOCK) * scales.unsqueeze(1)).view(-1)
        assert torch.equal(buf.get(), decoded)
    for (p1, s1), (p2, s2) in zip(_train(resumed, [2, 3]), _train(reference, [2, 3])):
        assert torch.equal(p1, p2) and torch.equal(s1, s2)
    for key, buf in resumed.state.compensator.errors.items():
        other = reference.state.compensator.errors[key]
        assert torch.equal(buf.codes, other.codes) and torch.equal(buf.scales, other.scales)
        assert torch.isfinite(buf.get()).all()
