"""YAML run configs (``--config FILE``): Megatron-LM flags as keys plus a ``loco:`` section.

A config file is a YAML mapping. Every top-level key is a Megatron-LM flag written as on the
command line without the leading ``--`` (``num-layers: 32``); ``loco:`` is a mapping whose keys
are the ``--loco-*`` flags without ``--loco-`` (``bits: 4``, ``err-beta: 0.8``; ``err_beta``
also accepted), generated from the settings registry (:data:`loco_megatron.config.SETTINGS`)
so every ``LoCoConfig`` field has one. Values become arguments:

* ``true`` -> the bare flag (``--bf16``); ``false`` and ``null`` -> nothing (the default stays);
* a list -> the flag followed by each item (``data-path: [0.5, a, 0.5, b]``);
* any other scalar -> the flag and ``str(value)``.

:func:`expand_config_argv` replaces ``--config FILE`` by the file's arguments placed *before*
the remaining command-line arguments; argparse keeps the last occurrence of a flag, so the
command line wins over the file and the file over the parser's defaults (CLI > YAML > defaults).

Megatron-LM's own ``--yaml-cfg`` (megatron/training/yaml_arguments.py) is a different format;
its ``loco:`` section is read by :func:`loco_megatron.cli.flags.config_from_args`.

Run ``python -m loco_megatron.cli.yaml_config ARGS...`` to print the expanded arguments
shell-quoted on one line (used by ``run_pretrain.sh``).
"""

import re
import shlex
import sys
from typing import Any, Dict, List, Sequence

from ..config import SETTINGS, LoCoConfig, LoCoConfigError, value_type
from .console import cli_exit_code

CONFIG_FLAG = "--config"
LOCO_PREFIX = "--loco-"
_FLAG_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def loco_keys() -> Dict[str, str]:
    """``loco:`` section key -> ``LoCoConfig`` field name, both spellings (``err-beta`` and
    ``err_beta``), from the settings registry (``--loco-err-beta`` -> ``beta``)."""
    keys = {}
    for field, setting in SETTINGS.items():
        keys[setting.yaml_key] = keys[setting.yaml_key.replace("-", "_")] = field
    return keys


def loco_section_to_fields(section: Any, source: str) -> Dict[str, Any]:
    """Validate a ``loco:`` section and return ``{LoCoConfig field: value}`` (nulls dropped),
    each value converted as argparse converts it (``typ(str(value))``: ``"4"`` -> ``4``,
    ``4.5`` for an int flag is an error).

    Args:
        section: the section's value: a mapping, or a ``SimpleNamespace`` as Megatron's
            ``load_yaml`` builds it.
        source: the file name for messages.

    Raises:
        LoCoConfigError: not a mapping, an unknown key, or a value of the wrong type; the message
            names ``source`` and the key.
    """
    if hasattr(section, "__dict__") and not isinstance(section, dict):
        section = vars(section)
    if not isinstance(section, dict):
        raise LoCoConfigError(f"{source}: 'loco' must be a mapping of --loco-* settings "
                              f"(e.g. 'loco: {{bits: 4}}'), got {section!r}.")
    keys = loco_keys()
    out, seen = {}, {}
    for key, value in section.items():
        field = keys.get(str(key))
        if field is None:
            names = ", ".join(sorted(k for k in keys if "_" not in k))
            raise LoCoConfigError(f"{source}: unknown key 'loco.{key}'; the loco section takes "
                                  f"the --loco-* flags without '--loco-': {names}.")
        if field in seen:
            raise LoCoConfigError(f"{source}: 'loco.{key}' and 'loco.{seen[field]}' are the same "
                                  f"setting ({SETTINGS[field].flag}); keep one.")
        seen[field] = key
        if value is None:
            continue
        flag, typ = SETTINGS[field].flag, value_type(field)
        try:
            if isinstance(value, bool) != (typ is bool):
                raise TypeError(value)  # int(True) == 1, bool("false") would pass silently
            out[field] = value if isinstance(value, bool) else typ(str(value))
        except (TypeError, ValueError):
            raise LoCoConfigError(f"{source}: loco.{key}: {value!r} is not a valid value for "
                                  f"{flag} ({typ.__name__} expected).") from None
    return out


def load_config(path: str, flag: str = CONFIG_FLAG) -> Dict[str, Any]:
    """Read a ``--config`` YAML file (PyYAML ``safe_load``) into a mapping (``flag``: the
    option named in messages, e.g. Megatron's ``--yaml-cfg``).

    Raises:
        LoCoConfigError: the file cannot be read or parsed, or is not a mapping; names ``path``.
    """
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise LoCoConfigError(f"{flag} {path}: cannot read the file ({e.strerror or e}).") \
            from None
    except yaml.YAMLError as e:
        raise LoCoConfigError(f"{flag} {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise LoCoConfigError(f"{flag} {path}: expected a mapping of Megatron-LM flags "
                              f"('num-layers: 32', ...), got {type(data).__name__}.")
    return data


def _flag_args(flag: str, value: Any, source: str, key: str) -> List[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        if not value or any(isinstance(v, (dict, list, tuple)) or v is None for v in value):
            raise LoCoConfigError(f"{source}: key '{key}': a list value must hold one or more "
                                  f"plain values (they follow {flag} on the command line).")
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        raise LoCoConfigError(f"{source}: key '{key}' holds a mapping, but only 'loco' may; "
                              f"Megatron-LM flags are flat ('{key}: VALUE').")
    return [flag, str(value)]


def config_to_argv(path: str) -> List[str]:
    """The command-line arguments a ``--config`` file stands for (Megatron flags in file order,
    then the ``--loco-*`` flags of its ``loco:`` section).

    Raises:
        LoCoConfigError: unreadable file, not a mapping, a malformed key, a nested mapping other
            than ``loco``, an unknown ``loco`` key or an invalid LoCo value; names file and key.
    """
    data = load_config(path)
    source = f"--config {path}"
    argv, loco = [], []
    for key, value in data.items():
        if key == "loco":
            fields = loco_section_to_fields(value if value is not None else {}, source)
            try:  # each value on its own: a switch given on the command line (which wins,
                # e.g. --loco-hierarchical for the section's intra-node-bits) may complete it;
                # the whole configuration is checked once the arguments are parsed
                LoCoConfig(**{**fields, "hierarchical": True} if "intra_node_bits" in fields
                           else fields)
            except LoCoConfigError as e:
                raise LoCoConfigError(f"{source}, loco section: {e}") from None
            for field, val in fields.items():
                loco += _flag_args(SETTINGS[field].flag, val, source, f"loco.{field}")
            continue
        if not isinstance(key, str) or not _FLAG_KEY.match(key) or ("_" in key and "-" not in key):
            raise LoCoConfigError(
                f"{source}: key {key!r} is not a flag name; write Megatron-LM flags as on the "
                f"command line without '--' (e.g. 'num-layers: 32', not 'num_layers').")
        if key == "config":
            raise LoCoConfigError(f"{source}: key 'config': a config file cannot include "
                                  f"another; give both on the command line (--config A --config B).")
        if key.startswith("loco-"):
            raise LoCoConfigError(f"{source}: key '{key}': put LoCo settings in the 'loco:' "
                                  f"section ('loco: {{{key[5:]}: ...}}').")
        argv += _flag_args(f"--{key}", value, source, key)
    return argv + loco


def expand_config_argv(argv: Sequence[str]) -> List[str]:
    """Replace every ``--config FILE`` / ``--config=FILE`` in ``argv`` by the file's arguments,
    placed before all other arguments (files in the order given), so that explicit command-line
    flags win over the files. ``argv`` without ``--config`` is returned unchanged (as a list).

    Raises:
        LoCoConfigError: ``--config`` without a file, or any error of :func:`config_to_argv`.
    """
    files, rest = [], []
    it = iter(argv)
    for arg in it:
        if arg == CONFIG_FLAG:
            path = next(it, None)
            if path is None or path.startswith("--"):
                raise LoCoConfigError("--config needs a YAML file: --config configs/FILE.yaml")
            files.append(path)
        elif arg.startswith(CONFIG_FLAG + "="):
            files.append(arg[len(CONFIG_FLAG) + 1:])
        else:
            rest.append(arg)
    expanded = []
    for path in files:
        expanded += config_to_argv(path)
    return expanded + rest


def main(argv: Sequence[str] = None) -> int:
    """Print ``expand_config_argv(argv)`` shell-quoted on one line; on error print it and
    return 2."""
    return cli_exit_code(lambda args: print(shlex.join(expand_config_argv(args))), argv)


if __name__ == "__main__":
    sys.exit(main())
