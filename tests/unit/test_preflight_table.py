"""The preflight refuses exactly what the ranks refuse, with the same line.

One table of launch settings (2 ranks). Each row goes through
(a) the preflight: ``loco_megatron.cli.preflight.main(ARGS)``, what ``python -m
    loco_megatron.cli.preflight ARGS`` (``run_pretrain.sh``, before starting ranks) and every
    launch path's start-up run, with ``WORLD_SIZE=2`` as a launcher sets it;
(b) the ranks' checks, fed by Megatron-LM's own argument parser
    (``megatron.training.arguments.parse_args``, LoCo's flags added as the launch paths add
    them): ``check_megatron_args`` as ``install_from_args`` calls it, then what the wrapped
    megatron-core constructors refuse: the DDP config (``plugin.check_ddp_config``,
    ``param_sync.check_ddp_config``) and the optimizer config (the precision-aware optimizer).
The outcomes (accepted, or the refusal's line) must be equal row by row.
"""

import sys

import pytest

from loco_megatron.config import LoCoConfigError, check_param_bits_conflicts
from tests.helpers.markers import requires_megatron_training

pytestmark = requires_megatron_training
WORLD = 2
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"]
DIST = ["--use-distributed-optimizer"]
#: one CUDA graph of the whole iteration (Megatron asks for its NaN check off with it)
FULL_GRAPH = ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
#: (row id, the launch's flags beyond the model's, refused?) - refused is what the table says
#: a user gets; the test checks it and that both paths agree on it and on the line
TABLE = [
    ("loco4-no-distopt", ["--loco-bits", "4"], True),
    ("param4-no-distopt", ["--loco-param-bits", "4"], True),
    ("loco4-distopt", ["--loco-bits", "4", *DIST], False),
    ("param4-distopt", ["--loco-param-bits", "4", *DIST], False),
    ("both4-distopt", ["--loco-bits", "4", "--loco-param-bits", "8", *DIST], False),
    ("loco16-no-distopt", ["--loco-bits", "16"], False),
    ("unset-no-distopt", [], False),
    ("loco4-fp32-accumulation", ["--loco-bits", "4", *DIST,
                                 "--ddp-reduce-scatter-with-fp32-accumulation"], True),
    ("loco4-per-token-loss", ["--loco-bits", "4", *DIST, "--calculate-per-token-loss"], True),
    ("param4-precision-aware", ["--loco-param-bits", "4", *DIST,
                                "--use-precision-aware-optimizer"], True),
    ("loco4-fsdp", ["--loco-bits", "4", "--use-megatron-fsdp"], True),
    ("loco4-tp2-dp1-no-distopt", ["--loco-bits", "4", "--tensor-model-parallel-size", "2"], False),
    ("param4-tp2-dp1-no-distopt", ["--loco-param-bits", "4",
                                   "--tensor-model-parallel-size", "2"], False),
    ("loco3", ["--loco-bits", "3", *DIST], True),
    ("loco4-full-iteration-graph", ["--loco-bits", "4", *DIST, *FULL_GRAPH], True),
    ("param4-full-iteration-graph", ["--loco-param-bits", "4", *DIST, *FULL_GRAPH], True),
    ("loco16-full-iteration-graph", ["--loco-bits", "16", *DIST, *FULL_GRAPH], False),
    ("loco4-per-layer-graphs", ["--loco-bits", "4", *DIST, "--cuda-graph-impl", "local",
                                "--cuda-graph-modules", "attn"], False),
]


def _preflight(flags, monkeypatch, capsys):
    """(a): ``None`` when accepted, else the ``error: ...`` line's text (in-process: the same
    ``main`` as the command; ``tests/unit/data/test_data_check.py`` runs the command itself)."""
    from loco_megatron.cli.preflight import main

    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    capsys.readouterr()
    rc = main([*MODEL, *flags])
    err = capsys.readouterr().err
    if rc == 0:
        assert err == "", err
        return None
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), (rc, err)
    return err[len("error: "):].strip()


def _rank_args(flags, monkeypatch):
    """Megatron-LM's parsed arguments on a rank of a ``WORLD``-rank job, with the sizes
    ``validate_args`` derives (megatron/training/arguments.py)."""
    from megatron.training.arguments import parse_args

    from loco_megatron.training.startup import extra_args_provider

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MODEL, *flags])
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    args = parse_args(extra_args_provider=extra_args_provider)
    model = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
             * args.context_parallel_size)
    args.data_parallel_size = args.world_size // model
    return args


def _ranks(flags, monkeypatch):
    """(b): ``None`` when accepted, else the LoCoConfigError's text."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from loco_megatron.cli.preflight import check_megatron_args, gradient_dp_size
    from loco_megatron.megatron import param_sync, plugin
    from loco_megatron.training.startup import loco_config

    try:
        args = _rank_args(flags, monkeypatch)
        config = loco_config(args)
        check_megatron_args(args, config)  # install_from_args
        dp = gradient_dp_size(args)
        ddp = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
        if config.enabled:  # the DDP constructor's wrapper
            plugin.check_ddp_config(ddp, dp, per_token_loss=args.calculate_per_token_loss)
        if config.params_enabled:
            param_sync.check_ddp_config(ddp, dp, config.param_bits)
            if args.use_distributed_optimizer and dp > 1:  # the optimizer's wrapper
                check_param_bits_conflicts(OptimizerConfig(
                    optimizer="adam", lr=1e-3,
                    use_precision_aware_optimizer=args.use_precision_aware_optimizer),
                    config.param_bits)
    except LoCoConfigError as e:
        return str(e)
    except SystemExit as e:  # the flag's own argparse error (Megatron's parser)
        return f"argparse exit {e.code}"
    return None


@pytest.mark.parametrize("flags,refused", [(f, r) for _, f, r in TABLE],
                         ids=[name for name, _, _ in TABLE])
def test_preflight_and_ranks_agree(flags, refused, monkeypatch, capsys):
    ranks = _ranks(flags, monkeypatch)
    preflight = _preflight(flags, monkeypatch, capsys)
    assert (preflight is not None) == refused, preflight
    if ranks is not None and ranks.startswith("argparse exit"):  # --loco-bits 3: argparse
        assert "--loco-bits 3" in preflight  # choices on the ranks, LoCoConfig in the preflight
        return
    assert preflight == ranks


def test_megatron_yaml_sections_count(tmp_path, monkeypatch):
    """Megatron-LM's ``--yaml-cfg`` nests the parallel sizes (``model_parallel:``); the preflight
    reads them there: TP 2 on 2 ranks is DP 1, where plain DDP with LoCo is accepted (nothing
    is compressed), and TP 1 is refused, as the ranks do (``validate_yaml``'s DP size)."""
    from loco_megatron.cli.preflight import preparse_loco_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "megatron.yaml"
    for tp, refused in ((2, False), (1, True)):
        path.write_text(f"loco_bits: 4\nuse_distributed_optimizer: false\nmodel_parallel:\n"
                        f"  tensor_model_parallel_size: {tp}\n")
        if refused:
            with pytest.raises(LoCoConfigError, match="needs the distributed optimizer"):
                preparse_loco_config(["--yaml-cfg", str(path)])
        else:
            assert preparse_loco_config(["--yaml-cfg", str(path)]).bits == 4
