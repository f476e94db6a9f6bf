"""``--loco-*`` command-line flags for Megatron-LM, generated from :class:`LoCoConfig`.

``add_loco_args`` has the ``extra_args_provider`` signature of Megatron-LM's argument parser
(megatron/training/arguments.py: ``parse_args(extra_args_provider=...)``). ``config_from_args``
reads the settings back with defaults for missing attributes, because ``--yaml-cfg`` replaces
the argparse namespace and the flags may then be absent.
"""

import argparse
import sys
from dataclasses import MISSING, fields

from ..config import ERROR_DTYPES, INTRA_NODE_BITS, KERNEL_CHOICES, LoCoConfig, LoCoConfigError

#: dataclass field -> (flag, type, extra argparse kwargs); type ``bool`` with
#: ``argparse.BooleanOptionalAction`` is a switch with a ``--no-`` form (YAML: ``true``/``false``)
FLAGS = {
    "bits": ("--loco-bits", int, {"metavar": "{4,8,16,32}"}),
    "beta": ("--loco-err-beta", float, {"metavar": "BETA"}),
    "reset_interval": ("--loco-reset-interval", int, {"metavar": "STEPS"}),
    "block_size": ("--loco-block-size", int, {"metavar": "N"}),
    "error_dtype": ("--loco-error-dtype", str, {"choices": ERROR_DTYPES}),
    "start_iter": ("--loco-start-iter", int, {"metavar": "STEPS"}),
    "kernels": ("--loco-kernels", str, {"choices": KERNEL_CHOICES}),
    "hierarchical": ("--loco-hierarchical", bool, {"action": argparse.BooleanOptionalAction}),
    "intra_node_bits": ("--loco-intra-node-bits", int, {"choices": INTRA_NODE_BITS}),
}


def _first_line(doc: str) -> str:
    return " ".join((doc or "").split())


def add_loco_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--loco-*`` flags (an argument group "LoCo") to a Megatron-LM parser."""
    group = parser.add_argument_group(title="LoCo low-bit gradient communication")
    docs = _field_docs()
    for f in fields(LoCoConfig):
        flag, typ, extra = FLAGS[f.name]
        default = None if f.default is MISSING else f.default
        if "action" not in extra:
            extra = {"type": typ, **extra}
        group.add_argument(flag, default=default, dest=f"loco_{f.name}",
                           help=f"{_first_line(docs.get(f.name, ''))} (default: {default})",
                           **extra)
    return parser


def config_from_args(args, argv=None) -> LoCoConfig:
    """Build a :class:`LoCoConfig` from a Megatron args namespace (missing flags -> defaults).

    With an argparse namespace the ``loco_<field>`` attributes already hold CLI > defaults (and
    ``--config`` files, expanded before parsing, in between). Under Megatron-LM's ``--yaml-cfg``
    (``args.yaml_cfg`` set), ``load_yaml`` (megatron/training/yaml_arguments.py) has replaced
    the namespace by the YAML's content, a ``SimpleNamespace`` in which the ``--loco-*`` values
    are lost; the settings are then read, highest precedence first, from: ``--loco-*`` flags
    given explicitly in ``argv`` (default ``sys.argv[1:]``); the YAML's ``loco:`` section
    (``args.loco``, keys as in ``--config`` files: ``bits``, ``err_beta``, ...); top-level
    ``loco_<field>`` keys of the YAML; the ``LoCoConfig`` defaults.

    Raises:
        LoCoConfigError: invalid values, naming the flag; an unknown key or a non-mapping
            ``loco:`` section, naming the YAML file and the key.
    """
    yaml_cfg = getattr(args, "yaml_cfg", None)
    if yaml_cfg is None:
        return LoCoConfig(**{f.name: getattr(args, f"loco_{f.name}") for f in fields(LoCoConfig)
                             if getattr(args, f"loco_{f.name}", None) is not None})
    from .yaml_config import loco_section_to_fields

    source = f"--yaml-cfg {yaml_cfg}"
    top = {}  # top-level keys, as the argparse dest (loco_beta) or the flag (loco_err_beta)
    for name, (flag, _typ, _extra) in FLAGS.items():
        for attr in (f"loco_{name}", flag[2:].replace("-", "_")):
            if getattr(args, attr, None) is not None:
                top[flag[len("--loco-"):]] = getattr(args, attr)
    kwargs = loco_section_to_fields(top, source)
    section = getattr(args, "loco", None)
    if section is not None:
        kwargs.update(loco_section_to_fields(section, source))
    kwargs.update(explicit_loco_flags(sys.argv[1:] if argv is None else argv))
    try:
        return LoCoConfig(**kwargs)
    except LoCoConfigError as e:
        raise LoCoConfigError(f"{source} (LoCo settings from it and the command line): {e}") \
            from None


class _RaisingParser(argparse.ArgumentParser):
    """An argparse parser whose errors raise :class:`LoCoConfigError` (one line through the
    launcher's ``fail``) instead of printing a partial usage text and exiting on every rank."""

    def error(self, message):
        raise LoCoConfigError(message)


def explicit_loco_flags(argv) -> dict:
    """``{LoCoConfig field: value}`` for the ``--loco-*`` flags present in ``argv`` (others and
    unknown arguments ignored), converted with the flags' types.

    Raises:
        LoCoConfigError: a value that does not convert, naming the flag.
    """
    parser = _RaisingParser(add_help=False, allow_abbrev=False)
    for name, (flag, typ, extra) in FLAGS.items():
        kw = {k: v for k, v in extra.items() if k in ("action", "nargs", "const")}
        if "action" not in kw:
            kw["type"] = typ
        parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, **kw)
    known, _ = parser.parse_known_args(list(argv))
    return vars(known)


def _field_docs():
    """Field docstrings of LoCoConfig (the string literal under each field)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(LoCoConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and \
                isinstance(getattr(nxt, "value", None), ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs


def check_megatron_args(args, config: LoCoConfig) -> None:
    """Refuse, at start-up, Megatron settings under which LoCo would not compress.

    Megatron FSDP (``--use-megatron-fsdp``, ``--use-custom-fsdp`` before 0.14) and torch FSDP2
    replace megatron-core's DDP gradient buffers entirely; the others are checked as on the DDP
    config (:func:`loco_megatron.megatron.plugin.check_ddp_config`).

    Raises:
        LoCoConfigError: naming the conflicting flag.
    """
    if not config.enabled:
        return
    _check_fsdp(args, config)
    if config.hierarchical:  # LOCAL_WORLD_SIZE from the launcher, at start-up
        from ..hierarchical import local_world_size

        local_world_size()
    from .plugin import check_ddp_config

    check_ddp_config(argparse.Namespace(
        use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        reduce_scatter_with_fp32_accumulation=getattr(
            args, "ddp_reduce_scatter_with_fp32_accumulation", False)), gradient_dp_size(args))


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


_FSDP_FLAGS = (("use_megatron_fsdp", "--use-megatron-fsdp"), ("use_custom_fsdp", "--use-custom-fsdp"),
               ("use_torch_fsdp2", "--use-torch-fsdp2"))


def _check_fsdp(args, config: LoCoConfig) -> None:
    for attr, flag in _FSDP_FLAGS:
        if config.enabled and getattr(args, attr, False):
            raise LoCoConfigError(
                f"--loco-bits {config.bits} cannot be used with {flag}: FSDP replaces "
                f"megatron-core's DDP gradient buffers that LoCo compresses; drop one of the two.")


def preparse_loco_config(argv) -> LoCoConfig:
    """Read only the ``--loco-*`` flags (and the FSDP switches) from ``argv`` before Megatron's
    slow start-up, so that bad values and FSDP fail within a second.

    Raises:
        LoCoConfigError: naming the flag.
    """
    parser = add_loco_args(_RaisingParser(add_help=False, allow_abbrev=False))
    for attr, flag in _FSDP_FLAGS:
        parser.add_argument(flag, dest=attr, action="store_true")
    known, _ = parser.parse_known_args(argv)
    config = config_from_args(known)
    _check_fsdp(known, config)
    return config


def main(argv=None) -> int:
    """``python -m loco_megatron.megatron.arguments ARGS``: check the ``--loco-*`` flags (and
    FSDP switches) and the ``--data-path`` files (:mod:`loco_megatron.data.check`) of ``ARGS``
    in about a second, before a launcher prepares data or starts ranks; prints ``error: ...``
    and returns 2 on a bad value, else returns 0 silently."""
    from ..data.check import DataPathError, check_data_args

    def check(args):
        preparse_loco_config(args)
        check_data_args(args)  # --data-path files: missing, truncated or corrupted .idx/.bin

    return cli_exit_code(check, argv, (LoCoConfigError, DataPathError))


def cli_exit_code(action, argv=None, errors=(LoCoConfigError,)) -> int:
    """The launchers' one-line refusal, shared by the ``python -m`` checks: run
    ``action(argv)`` (``sys.argv[1:]`` when ``argv`` is None); on one of ``errors`` print
    ``error: <message>`` to stderr and return 2, else return 0."""
    try:
        action(sys.argv[1:] if argv is None else list(argv))
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
