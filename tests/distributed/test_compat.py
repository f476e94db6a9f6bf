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
    from loco_megatron.training import pretrain_gpt

    monkeypatch.setattr(compat, "has_megatron_training", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt", "--loco-bits", "4"])
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    version = ".".join(map(str, compat.megatron_core_version()))
    for part in (f"megatron.training, which is not in this megatron-core {version} wheel",
                 "python -m loco_megatron.training.run_megatron_lm --megatron-lm", "MEGATRON_LM="):
        assert part in err, err


def test_bucket_param_ranges_point_at_each_main_grad(run_ranks):
    """compat.bucket_param_ranges gives where each parameter's main_grad really lies in its
    bucket's grad_data (0.13-0.16's param_to_index ignores the start padding; see compat)."""
    from .worker_megatron import param_ranges_worker

    for checked, padded in run_ranks(param_ranges_worker, 2):
        assert checked == 12 and padded > 0  # padding present, so the running sum would be wrong
