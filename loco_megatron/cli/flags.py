"""``--loco-*`` command-line flags for Megatron-LM, generated from :class:`LoCoConfig`.

``add_loco_args`` has the ``extra_args_provider`` signature of Megatron-LM's argument parser
(megatron/training/arguments.py: ``parse_args(extra_args_provider=...)``). ``config_from_args``
reads the settings back with defaults for missing attributes, because ``--yaml-cfg`` replaces
the argparse namespace and the flags may then be absent.
"""

import argparse
import sys
from dataclasses import fields

from ..config import SETTINGS, LoCoConfig, LoCoConfigError, value_type
from .yaml_config import loco_section_to_fields


def _flags():
    """field -> (flag, type, extra argparse kwargs), from the registry
    (:data:`loco_megatron.config.SETTINGS`); a ``bool`` field is a switch with a ``--no-`` form
    (``argparse.BooleanOptionalAction``; YAML ``true``/``false``)."""
    out = {}
    for name, setting in SETTINGS.items():
        typ, extra = value_type(name), dict(setting.argparse)
        if typ is bool:
            extra["action"] = argparse.BooleanOptionalAction
        out[name] = (setting.flag, typ, extra)
    return out


#: dataclass field -> (flag, type, extra argparse kwargs), derived from the settings registry
FLAGS = _flags()


def add_loco_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--loco-*`` flags (an argument group "LoCo"; one help line each, from
    :attr:`loco_megatron.config.Setting.help`) to a Megatron-LM parser."""
    group = parser.add_argument_group(title="LoCo low-bit gradient communication")
    for f in fields(LoCoConfig):
        flag, typ, extra = FLAGS[f.name]
        if "action" not in extra:
            extra = {"type": typ, **extra}
        group.add_argument(flag, default=f.default, dest=f"loco_{f.name}",
                           help=f"{SETTINGS[f.name].help} (default: {f.default})", **extra)
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


class RaisingParser(argparse.ArgumentParser):
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
    parser = RaisingParser(add_help=False, allow_abbrev=False)
    for name, (flag, typ, extra) in FLAGS.items():
        kw = {k: v for k, v in extra.items() if k in ("action", "nargs", "const")}
        if "action" not in kw:
            kw["type"] = typ
        parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, **kw)
    known, _ = parser.parse_known_args(list(argv))
    return vars(known)
