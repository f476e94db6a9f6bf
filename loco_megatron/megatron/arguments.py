"""``--loco-*`` command-line flags for Megatron-LM, generated from :class:`LoCoConfig`.

``add_loco_args`` has the ``extra_args_provider`` signature of Megatron-LM's argument parser
(megatron/training/arguments.py: ``parse_args(extra_args_provider=...)``). ``config_from_args``
reads the settings back with defaults for missing attributes, because ``--yaml-cfg`` replaces
the argparse namespace and the flags may then be absent.
"""

import argparse
from dataclasses import MISSING, fields

from ..config import ERROR_DTYPES, LoCoConfig

#: dataclass field -> (flag, type, extra argparse kwargs)
FLAGS = {
    "bits": ("--loco-bits", int, {"metavar": "{4,8,16,32}"}),
    "beta": ("--loco-err-beta", float, {"metavar": "BETA"}),
    "reset_interval": ("--loco-reset-interval", int, {"metavar": "STEPS"}),
    "block_size": ("--loco-block-size", int, {"metavar": "N"}),
    "error_dtype": ("--loco-error-dtype", str, {"choices": ERROR_DTYPES}),
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
