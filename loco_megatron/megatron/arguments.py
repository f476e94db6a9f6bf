"""``--loco-*`` command-line flags for Megatron-LM, generated from :class:`LoCoConfig`.

``add_loco_args`` has the ``extra_args_provider`` signature of Megatron-LM's argument parser
(megatron/training/arguments.py: ``parse_args(extra_args_provider=...)``). ``config_from_args``
reads the settings back with defaults for missing attributes, because ``--yaml-cfg`` replaces
the argparse namespace and the flags may then be absent.
"""

import argparse
from dataclasses import MISSING, fields

from ..config import ERROR_DTYPES, LoCoConfig, LoCoConfigError

#: dataclass field -> (flag, type, extra argparse kwargs)
FLAGS = {
    "bits": ("--loco-bits", int, {"metavar": "{4,8,16,32}"}),
    "beta": ("--loco-err-beta", float, {"metavar": "BETA"}),
    "reset_interval": ("--loco-reset-interval", int, {"metavar": "STEPS"}),
    "block_size": ("--loco-block-size", int, {"metavar": "N"}),
    "error_dtype": ("--loco-error-dtype", str, {"choices": ERROR_DTYPES}),
    "start_iter": ("--loco-start-iter", int, {"metavar": "STEPS"}),
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
        group.add_argument(flag, type=typ, default=default, dest=f"loco_{f.name}",
                           help=f"{_first_line(docs.get(f.name, ''))} (default: {default})",
                           **extra)
    return parser


def config_from_args(args) -> LoCoConfig:
    """Build a :class:`LoCoConfig` from a Megatron args namespace (missing flags -> defaults).

    Raises:
        LoCoConfigError: invalid values, naming the flag.
    """
    kwargs = {}
    for f in fields(LoCoConfig):
        value = getattr(args, f"loco_{f.name}", None)
        if value is not None:
            kwargs[f.name] = value
    return LoCoConfig(**kwargs)


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
    from .plugin import check_ddp_config

    check_ddp_config(argparse.Namespace(
        use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        reduce_scatter_with_fp32_accumulation=getattr(
            args, "ddp_reduce_scatter_with_fp32_accumulation", False)))


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
    parser = add_loco_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    for attr, flag in _FSDP_FLAGS:
        parser.add_argument(flag, dest=attr, action="store_true")
    known, _ = parser.parse_known_args(argv)
    config = config_from_args(known)
    _check_fsdp(known, config)
    return config
