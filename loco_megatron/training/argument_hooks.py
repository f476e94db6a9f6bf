"""LoCo inside an unmodified Megatron-LM ``pretrain_gpt.py``: hooks on its argument parsing.

Both entry-point styles of Megatron-LM's ``pretrain_gpt.py`` go through
``megatron/training/arguments.py``'s ``parse_args(extra_args_provider, ignore_unknown_args)``
and then, once the arguments are validated, ``megatron/training/global_vars.py``'s
``set_global_variables(args)`` (checked at core_v0.16.1, core_v0.17.1, core_v0.18.2,
core_v0.19.0):

* core <= 0.17: ``pretrain(..., extra_args_provider=...)`` -> ``initialize_megatron`` ->
  ``parse_args`` -> ``validate_args`` / ``validate_yaml`` -> ``set_global_variables``;
* core >= 0.18: ``parse_and_validate_args(extra_args_provider=...)`` -> the same three steps,
  then ``pretrain(cfg_container, ...)``.

:func:`enable_loco` hooks those two functions: ``parse_args`` gets the script's own provider
chained with LoCo's (:func:`loco_megatron.training.startup.chain_args_providers`), and just
before the first ``set_global_variables`` LoCo is configured, checked and installed
(:func:`loco_megatron.training.startup.install_from_args`): before any model or DDP exists.
Used by the wrapper (:mod:`loco_megatron.training.run_megatron_lm`) and by the patched scripts of
``patches/``.
"""

import functools
import sys
from typing import Optional, Sequence

from ..patching import PatchSet, active
from . import startup

#: the patch set of :func:`hook_megatron_arguments` (kept for the life of the process)
PATCH_SET = "loco-argument-hooks"
_ENABLED = []


def _rebind(patches: PatchSet, original, replacement) -> None:
    """Replace ``original`` by ``replacement`` in its module and wherever a loaded ``megatron``
    module imported it by name (``from ... import parse_args``), through ``patches``."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == original.__module__ or name.startswith("megatron")) \
                and getattr(module, original.__name__, None) is original:
            patches.replace(module, original.__name__, replacement)


def hook_megatron_arguments(emulated: bool) -> Optional[PatchSet]:
    """Chain LoCo's ``extra_args_provider`` into ``parse_args`` and install LoCo before the
    first ``set_global_variables`` (see the module docstring). Idempotent: returns the
    :class:`~loco_megatron.patching.PatchSet` it applied, or None when applied already."""
    import megatron.training.arguments as arguments
    import megatron.training.global_vars as global_vars

    if active(PATCH_SET):
        return None
    parse_args, set_global_variables = arguments.parse_args, global_vars.set_global_variables
    installed = []

    @functools.wraps(parse_args)
    def parse_args_with_loco(extra_args_provider=None, *args, **kwargs):
        return parse_args(startup.chain_args_providers(extra_args_provider), *args, **kwargs)

    @functools.wraps(set_global_variables)
    def set_global_variables_with_loco(args, *rest, **kwargs):
        if not installed:
            installed.append(startup.install_from_args(args, emulated))
        return set_global_variables(args, *rest, **kwargs)

    patches = PatchSet(PATCH_SET)
    _rebind(patches, parse_args, parse_args_with_loco)
    _rebind(patches, set_global_variables, set_global_variables_with_loco)
    return patches


def enable_loco(argv: Optional[Sequence[str]] = None) -> None:
    """Make the ``megatron`` package on ``sys.path`` run with LoCo: expand ``--config FILE``
    and check the ``--loco-*`` flags of ``argv`` (default ``sys.argv[1:]``, expanded in
    place), switch the CPU emulation on without a GPU,
    apply the training fixes (:func:`loco_megatron.training.startup.prepare`), then hook
    Megatron's argument parsing (:func:`hook_megatron_arguments`). Call it before Megatron
    parses its arguments, best before ``megatron`` is imported. Idempotent.

    Exits with a one-line error (status 2) on a bad ``--loco-*`` value.
    """
    if _ENABLED:
        return
    emulated = startup.prepare(argv)
    hook_megatron_arguments(emulated)
    _ENABLED.append(emulated)
