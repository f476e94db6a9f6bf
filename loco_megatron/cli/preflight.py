"""Preflight checks of a launch, before Megatron's slow start-up: the ``--loco-*`` flags, FSDP
switches, the ``--data-path`` files and the DDP settings LoCo cannot compress.

``python -m loco_megatron.cli.preflight ARGS`` runs them on a command line in about a second
(``run_pretrain.sh`` and the Slurm scripts call it before starting ranks); the launch paths call
:func:`preparse_loco_config` and :func:`check_megatron_args` themselves
(:mod:`loco_megatron.training.startup`).
"""

import argparse
import sys
from types import SimpleNamespace

from ..config import (PARAM_BITS_CONFLICTS, LoCoConfig, LoCoConfigError,
                      check_param_bits_conflicts)
from .console import cli_exit_code
from .flags import RaisingParser, add_loco_args, config_from_args
from .yaml_config import expand_config_argv, load_config


def check_megatron_args(args, config: LoCoConfig, at_launch: bool = False) -> None:
    """Refuse, at start-up, Megatron settings under which LoCo would not compress.

    Megatron FSDP (``--use-megatron-fsdp``, ``--use-custom-fsdp`` before 0.14) and torch FSDP2
    replace megatron-core's DDP gradient buffers entirely; the others are checked as on the DDP
    config (:func:`loco_megatron.megatron.plugin.check_ddp_config`), ``--calculate-per-token-loss``
    among them (when gradients are communicated). The ranks call it with Megatron's validated
    args; the preflight (``at_launch``) with the flags read from the command line
    (:func:`preparse_loco_config`), where ``LOCAL_WORLD_SIZE`` (``--loco-hierarchical``) is not
    set yet.

    Raises:
        LoCoConfigError: naming the conflicting flag.
    """
    _check_fsdp(args, config)
    _check_param_gather(args, config)
    _check_cuda_graphs(args, config)
    if config.params_enabled:
        from ..megatron.param_sync import check_ddp_config as check_param_config

        check_param_config(argparse.Namespace(
            use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False)),
            gradient_dp_size(args), config.param_bits)
    if not config.enabled:
        return
    if config.hierarchical and not at_launch:  # LOCAL_WORLD_SIZE from the launcher
        from ..hierarchical import local_world_size

        local_world_size()
    from ..megatron.plugin import check_ddp_config

    check_ddp_config(argparse.Namespace(
        use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        reduce_scatter_with_fp32_accumulation=getattr(
            args, "ddp_reduce_scatter_with_fp32_accumulation", False)), gradient_dp_size(args),
        per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)))


def gradient_dp_size(args) -> int:
    """The most ranks any gradient buffer is reduced over, from Megatron's validated args:
    DP x CP for dense parameters, ``world / (expert TP x EP x PP)`` for experts (megatron-core
    parallel_state.py). 1: nothing is communicated, so LoCo has nothing to refuse or compress.
    Missing fields (args not validated by Megatron) count as 2 (a DP group to check)."""
    dp = getattr(args, "data_parallel_size", None)
    if not isinstance(dp, int):
        return 2
    dense = dp * int(getattr(args, "context_parallel_size", 1) or 1)
    if not getattr(args, "num_experts", None):
        return dense
    world = getattr(args, "world_size", None)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    expert = world // (etp * ep * pp) if isinstance(world, int) else 2
    return max(dense, expert)


def _check_param_gather(args, config: LoCoConfig) -> None:
    """Megatron-LM flags whose parameter all-gather (or fp32 main parameters)
    ``--loco-param-bits`` cannot replace (``config.PARAM_BITS_CONFLICTS``): refused as early as the
    FSDP switches."""
    if config.params_enabled:
        check_param_bits_conflicts(args, config.param_bits)


#: ``(dest, flag)`` of the Megatron-LM flags among those conflicts
_PARAM_GATHER_FLAGS = tuple((attr, what) for attr, what, _ in PARAM_BITS_CONFLICTS
                            if what.startswith("--"))


def _check_cuda_graphs(args, config: LoCoConfig) -> None:
    """One CUDA graph of the whole forward-backward (``--cuda-graph-impl full_iteration``;
    ``--cuda-graph-scope full_iteration`` in megatron-core 0.14-0.16) captures
    ``finish_grad_sync`` once: on replay LoCo's host-side decisions (step counters, error
    resets, ``--loco-start-iter``, byte counters, the NaN/Inf monitor) stay as captured.
    Per-layer graphs (``local`` / ``transformer_engine`` with ``--cuda-graph-modules``) hold no
    gradient communication and keep working."""
    if not (config.enabled or config.params_enabled):
        return
    impl = str(getattr(args, "cuda_graph_impl", None) or "none")
    scopes = {str(getattr(s, "name", s)) for attr in ("cuda_graph_scope", "cuda_graph_modules")
              for s in _as_list(getattr(args, attr, None))}
    if impl != "full_iteration" and "full_iteration" not in scopes:
        return
    flag = ("--cuda-graph-impl full_iteration" if impl == "full_iteration"
            else "--cuda-graph-scope full_iteration")
    loco = (f"--loco-bits {config.bits}" if config.enabled
            else f"--loco-param-bits {config.param_bits}")
    raise LoCoConfigError(
        f"{flag} cannot be used with {loco}: one CUDA graph of the whole iteration replays "
        f"LoCo's gradient communication as captured, freezing its step counters, error "
        f"resets and NaN/Inf checks; use per-layer graphs (--cuda-graph-impl local or "
        f"transformer_engine) or drop one of the two.")


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


_FSDP_FLAGS = (("use_megatron_fsdp", "--use-megatron-fsdp"), ("use_custom_fsdp", "--use-custom-fsdp"),
               ("use_torch_fsdp2", "--use-torch-fsdp2"))


def _check_fsdp(args, config: LoCoConfig) -> None:
    for attr, flag in _FSDP_FLAGS:
        if config.enabled and getattr(args, attr, False):
            raise LoCoConfigError(
                f"--loco-bits {config.bits} cannot be used with {flag}: FSDP replaces "
                f"megatron-core's DDP gradient buffers that LoCo compresses; drop one of the two.")


#: ``(dest, flag, type, default)`` of the Megatron-LM flags :func:`check_megatron_args` reads
#: besides the FSDP and parameter all-gather switches (megatron/training/arguments.py)
_MEGATRON_FLAGS = (
    ("use_distributed_optimizer", "--use-distributed-optimizer", bool, False),
    ("ddp_reduce_scatter_with_fp32_accumulation", "--ddp-reduce-scatter-with-fp32-accumulation",
     bool, False),
    ("calculate_per_token_loss", "--calculate-per-token-loss", bool, False),
    ("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances", int, 1),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size", int, 1),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", int, 1),
    ("context_parallel_size", "--context-parallel-size", int, 1),
    ("num_experts", "--num-experts", int, None),
    ("expert_model_parallel_size", "--expert-model-parallel-size", int, 1),
    ("expert_tensor_parallel_size", "--expert-tensor-parallel-size", int, None),
    ("cuda_graph_impl", "--cuda-graph-impl", str, "none"),
    ("cuda_graph_scope", "--cuda-graph-scope", list, None),
    ("cuda_graph_modules", "--cuda-graph-modules", list, None),
)


def preparse_loco_config(argv) -> LoCoConfig:
    """Read the ``--loco-*`` flags and the Megatron-LM flags LoCo's refusals depend on from
    ``argv`` before Megatron's slow start-up, and refuse there, with the ranks' own line, what
    the ranks would refuse (:func:`check_megatron_args`), within a second. The DP size comes
    from ``WORLD_SIZE`` when the launcher set it (the ranks), else counts as more than one (a
    data-parallel job: what LoCo is for). With Megatron-LM's ``--yaml-cfg FILE`` the file's
    settings count too (its ``loco:`` section and ``loco_*`` keys, below the command line's
    flags, as :func:`loco_megatron.cli.flags.config_from_args` reads them after Megatron's
    ``load_yaml``, and its Megatron keys).

    Raises:
        LoCoConfigError: naming the flag (or the ``--yaml-cfg`` file and key).
    """
    parser = add_loco_args(RaisingParser(add_help=False, allow_abbrev=False))
    for attr, flag in dict(_FSDP_FLAGS + _PARAM_GATHER_FLAGS).items():
        parser.add_argument(flag, dest=attr, action="store_true")
    for attr, flag, kind, default in _MEGATRON_FLAGS:
        if kind is bool:
            parser.add_argument(flag, dest=attr, action="store_true")
        elif kind is list:
            parser.add_argument(flag, dest=attr, nargs="+", default=default)
        else:
            parser.add_argument(flag, dest=attr, type=kind, default=default)
    parser.add_argument("--yaml-cfg", dest="yaml_cfg", default=None)
    known, _ = parser.parse_known_args(argv)
    if known.yaml_cfg is not None:
        data = load_config(known.yaml_cfg, "--yaml-cfg")
        # the file may hold a yaml_cfg key itself (Megatron's load_yaml overwrites it)
        config = config_from_args(SimpleNamespace(**{**{str(k): v for k, v in data.items()},
                                                     "yaml_cfg": known.yaml_cfg}), argv)
        flat = {str(k): v for k, v in data.items() if not isinstance(v, dict)}
        for section, values in data.items():  # Megatron's nested sections (model_parallel: ...)
            if isinstance(values, dict) and section != "loco":
                flat.update({str(k): v for k, v in values.items() if not isinstance(v, dict)})
        known = SimpleNamespace(**{**vars(known), **{k: v for k, v in flat.items()
                                                     if hasattr(known, k)}})
    else:
        config = config_from_args(known)
    _check_fsdp(known, config)
    _check_param_gather(known, config)
    check_megatron_args(_with_dp_size(known), config, at_launch=True)
    return config


def _with_dp_size(args):
    """``args`` with ``world_size`` and ``data_parallel_size`` from ``WORLD_SIZE`` (set by
    torchrun), as Megatron derives them; unchanged when it is not set."""
    import os

    world = os.environ.get("WORLD_SIZE", "")
    if not world.isdigit():
        return args
    model = 1
    for attr in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        model *= int(getattr(args, attr, 1) or 1)
    return SimpleNamespace(**{**vars(args), "world_size": int(world),
                              "data_parallel_size": max(1, int(world) // model)})


def main(argv=None) -> int:
    """``python -m loco_megatron.cli.preflight ARGS``: check the ``--loco-*`` flags (and
    FSDP switches) and the ``--data-path`` files (:mod:`loco_megatron.data.check`) of ``ARGS``
    in about a second, before a launcher prepares data or starts ranks (``--config FILE``
    expanded first, as the launch paths do); prints ``error: ...`` and returns 2 on a bad
    value, else returns 0 silently."""
    from ..data.check import DataPathError, check_data_args

    def check(args):
        args = expand_config_argv(args)
        preparse_loco_config(args)
        check_data_args(args)  # --data-path files: missing, truncated or corrupted .idx/.bin

    return cli_exit_code(check, argv, (LoCoConfigError, DataPathError))


if __name__ == "__main__":
    sys.exit(main())
