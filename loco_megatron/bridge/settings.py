"""LoCo's settings in a Megatron-Bridge recipe: from Python, a YAML file's ``loco:`` section and
``loco.*`` command-line overrides beside Bridge's Hydra overrides.

Bridge's ``ConfigContainer`` has a fixed set of fields, and its YAML merge and Hydra overrides
(megatron/bridge/training/utils/omegaconf_utils.py ``process_config_with_overrides``) refuse
unknown keys, so LoCo's settings are taken out first:

* a YAML file's top-level ``loco:`` section and ``loco.KEY=VALUE`` overrides use the keys of
  Megatron-LM's ``--config`` files (docs/configs.md): the ``--loco-*`` flags without
  ``--loco-`` (``bits``, ``err-beta`` or ``err_beta``, ``param-bits``), from the settings
  registry (:data:`loco_megatron.config.SETTINGS`), so every ``LoCoConfig`` field has one;
* precedence, as on the other launch paths: command line > YAML file > Python (``base``) >
  ``LoCoConfig``'s defaults.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..cli.yaml_config import load_config, loco_section_to_fields
from ..config import LoCoConfig, LoCoConfigError

#: the YAML section and the override prefix
SECTION = "loco"
PREFIX = SECTION + "."

LoCoLike = Union[None, LoCoConfig, Dict[str, Any]]


def split_overrides(overrides: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    """Take the ``loco.KEY=VALUE`` overrides out of a Hydra override list.

    Values are read as YAML scalars, as Hydra reads them (``loco.bits=4`` -> 4,
    ``loco.hierarchical=true`` -> True, ``loco.param-bits=null`` -> unset).

    Returns:
        ``({LoCoConfig field: value}, the other overrides in order)``.

    Raises:
        LoCoConfigError: an unknown key, a bad value, or ``loco.KEY`` without ``=VALUE``; the
            message names the override.
    """
    import yaml

    section, rest = {}, []
    for item in overrides:
        text = str(item)
        if not text.lstrip("+~").startswith(PREFIX):
            rest.append(text)
            continue
        key, sep, value = text.lstrip("+~").partition("=")
        if not sep or text.startswith("~"):
            raise LoCoConfigError(f"override '{text}': LoCo settings are set as "
                                  f"'loco.KEY=VALUE' (e.g. 'loco.bits=4').")
        try:
            section[key[len(PREFIX):]] = yaml.safe_load(value) if value else None
        except yaml.YAMLError:
            section[key[len(PREFIX):]] = value
    return _checked(lambda: loco_section_to_fields(section, "command-line override")), rest


def split_yaml(path: Optional[str]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Read a recipe YAML file and take its ``loco:`` section out.

    Returns:
        ``({LoCoConfig field: value}, the file's other keys for Bridge)``; both empty without
        ``path``.

    Raises:
        LoCoConfigError: the file is unreadable or not a mapping, or its ``loco:`` section has
            an unknown key or a bad value (named with the file).
    """
    if not path:
        return {}, {}
    data = load_config(path, flag="config file")
    section = data.pop(SECTION, None)
    fields = {} if section is None else _checked(lambda: loco_section_to_fields(section, str(path)))
    return fields, data


def as_config(loco: LoCoLike) -> Optional[LoCoConfig]:
    """``loco`` as a :class:`LoCoConfig`: one already, None (LoCo not asked for), or a mapping
    written like a YAML ``loco:`` section (``{"bits": 4, "err-beta": 0.8}``).

    Raises:
        LoCoConfigError: an unknown key or a bad value; anything else than these three.
    """
    if loco is None or isinstance(loco, LoCoConfig):
        return loco
    if isinstance(loco, dict):
        return _checked(lambda: LoCoConfig(**loco_section_to_fields(loco, "loco")))
    raise LoCoConfigError(f"loco: expected a LoCoConfig, a mapping of LoCo settings "
                          f"({{'bits': 4}}) or None, got {type(loco).__name__}.")


def merge(base: LoCoLike, *layers: Dict[str, Any]) -> Optional[LoCoConfig]:
    """``base`` with the fields of each layer applied in order (later wins); None when neither
    ``base`` nor any layer says anything (LoCo not asked for: nothing is installed)."""
    config = as_config(base)
    fields = {k: v for layer in layers for k, v in layer.items()}
    if not fields:
        return config
    return _checked(lambda: dataclasses.replace(config or LoCoConfig(), **fields))


def _checked(make):
    """``make()``, its LoCoConfigError in Bridge's words (``loco.bits=3``, not ``--loco-bits 3``)."""
    from .checks import in_bridge_words

    try:
        return make()
    except LoCoConfigError as e:
        raise LoCoConfigError(in_bridge_words(str(e))) from None


def process_config_with_overrides(config, config_filepath: Optional[str] = None,
                                  cli_overrides: Sequence[str] = (),
                                  loco: LoCoLike = None) -> Optional[LoCoConfig]:
    """Bridge's ``process_config_with_overrides`` with LoCo's part taken out first.

    Merges ``config_filepath`` (YAML, without its ``loco:`` section) and ``cli_overrides``
    (Hydra syntax, without the ``loco.*`` ones) into ``config`` (a Bridge ``ConfigContainer``,
    changed in place) through Bridge's own helpers, and returns the :class:`LoCoConfig`
    (command line > YAML > ``loco``), or None when LoCo was not asked for anywhere.

    Raises:
        LoCoConfigError: a bad LoCo setting (one line naming it).
        FileNotFoundError, OverridesError: as Bridge's own function.
    """
    from omegaconf import OmegaConf
    from megatron.bridge.training.utils import omegaconf_utils as ou

    from_yaml, rest_yaml = ({}, {})
    if config_filepath:
        import os

        if not os.path.exists(config_filepath):
            raise FileNotFoundError(f"Config file not found: {config_filepath}")
        from_yaml, rest_yaml = split_yaml(config_filepath)
    from_cli, rest_cli = split_overrides(cli_overrides)
    omega_conf, excluded = ou.create_omegaconf_dict_config(config)
    if rest_yaml:
        omega_conf = OmegaConf.merge(omega_conf, OmegaConf.create(rest_yaml))
    if rest_cli:
        omega_conf = ou.parse_hydra_overrides(omega_conf, rest_cli)
    ou.apply_overrides(config, OmegaConf.to_container(omega_conf, resolve=True), excluded)
    return merge(loco, from_yaml, from_cli)
