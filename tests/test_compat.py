"""The version adapter (loco_megatron/megatron/compat.py) on the installed megatron-core."""

import pytest

from loco_megatron.megatron import compat


def test_version_is_in_the_supported_range():
    assert (0, 13) <= compat.megatron_core_version()[:2] < (0, 20)


def test_features_match_the_release_that_introduced_them():
    version = compat.megatron_core_version()[:2]
    assert compat.has_megatron_training() == (version >= (0, 17))
    assert compat.supports_uneven_sharded_tensors() == (version >= (0, 15))
    assert compat.reshardable_sharding_type() == (
        "dp_reshardable" if version >= (0, 15) else "fully_sharded_model_space")


@pytest.mark.parametrize("args,kwargs,expected", [
    ((), {}, False), ((True,), {}, True), ((), {"force_all_reduce": True}, True)])
def test_force_all_reduce_argument(args, kwargs, expected):
    assert compat.force_all_reduce(args, kwargs) is expected


def test_main_job_without_megatron_training_fails_early_naming_the_checkout_wrapper(
        monkeypatch, capsys):
    from loco_megatron import pretrain_gpt

    monkeypatch.setattr(compat, "has_megatron_training", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt", "--loco-bits", "4"])
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    version = ".".join(map(str, compat.megatron_core_version()))
    for part in (f"megatron.training, which is not in this megatron-core {version} wheel",
                 "python -m loco_megatron.run_megatron_lm --megatron-lm", "MEGATRON_LM="):
        assert part in err, err


@pytest.mark.parametrize("version,tp,refused", [
    ((0, 16, 1), 2, True), ((0, 13, 1), 4, True), ((0, 16, 1), 1, False), ((0, 19, 2), 2, False)])
def test_tensor_parallel_refused_before_0_19(monkeypatch, version, tp, refused):
    from megatron.core import parallel_state as ps

    from loco_megatron.config import LoCoConfigError

    monkeypatch.setattr(compat, "megatron_core_version", lambda: version)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: tp)
    if not refused:
        compat.check_loco_tensor_parallel()
        return
    with pytest.raises(LoCoConfigError, match=f"--tensor-model-parallel-size {tp} needs "
                                              f"megatron-core >= 0.19"):
        compat.check_loco_tensor_parallel()
