"""Workarounds that ``megatron.training`` (shipped in megatron-core >= 0.17 wheels) needs.

* The 0.19.2 wheel ships the compiled dataset helper (``helpers_cpp*.so``) but not its
  Makefile, while ``megatron.training.initialize._compile_dependencies`` always runs ``make`` on
  rank 0 and exits when it fails: :func:`skip_helper_build_when_prebuilt` keeps the build only
  when the prebuilt helper is missing (any hardware), and in a Megatron-LM checkout builds it
  for the running interpreter (:func:`build_helper_with_this_python`).
* Without TE/apex, ``--load`` fails before the first optimizer step
  (:func:`init_torch_optimizer_states_before_load`).
* Without TE/apex, resuming is not exact and the ``torch`` format cannot be loaded
  (:func:`fix_torch_adamw_resume`).
* Under the CPU emulation, dynamo cannot trace through the torch function mode, so the JIT
  warm-up is skipped (:func:`skip_jit_warmup`).
"""

import importlib
import logging
import os
from typing import Any, List, Optional

import torch

from ..megatron import compat
from ..patching import PatchSet

logger = logging.getLogger(__name__)

#: the patch set holding every workaround applied in this process
PATCH_SET = "loco-workarounds"
_PATCHES: Optional[PatchSet] = None


#: why each workaround is in force, by ``(owner, attribute)``
_REASONS = {}


def _replace(owner: Any, attribute: str, value: Any, reason: str) -> bool:
    """Apply one workaround through the process's :class:`PatchSet`; False (nothing done) when
    it is applied already."""
    global _PATCHES
    if _PATCHES is None or not _PATCHES.is_applied:
        _PATCHES = PatchSet(PATCH_SET)
    if (owner, attribute) in _PATCHES.targets():
        return False
    _PATCHES.replace(owner, attribute, value)
    _REASONS[(owner, attribute)] = reason
    return True


def replace(owner: Any, attribute: str, value: Any, reason: str) -> bool:
    """Apply one workaround of another launch path (Megatron-Bridge's owners of the same
    fixes, :mod:`loco_megatron.bridge.workarounds`) in this process's patch set; False when that
    attribute is replaced already. Listed by :func:`applied`, restored by :func:`remove`."""
    return _replace(owner, attribute, value, reason)


def applied() -> List[str]:
    """``attribute (why)`` of every workaround in force, oldest first."""
    targets = _PATCHES.targets() if _PATCHES is not None else []
    return [f"{attribute} ({_REASONS[owner, attribute]})" for owner, attribute in targets]


def remove() -> None:
    """Restore everything the workarounds replaced (tests; a process normally keeps them)."""
    global _PATCHES
    if _PATCHES is not None:
        _PATCHES.restore()
        _PATCHES = None


def apply_needed(emulated: bool) -> List[str]:
    """Apply the workarounds this process needs and return what was applied (empty on a GPU
    machine with Transformer Engine or apex running a Megatron-LM checkout): the dataset-helper
    build skip where a prebuilt helper exists or a checkout needs this interpreter's flags, the
    torch-AdamW checkpoint fixes without TE/apex, the JIT warm-up skip under the CPU emulation.
    Idempotent."""
    skip_helper_build_when_prebuilt()
    init_torch_optimizer_states_before_load()
    fix_torch_adamw_resume()
    if emulated:
        skip_jit_warmup()
    return applied()


def escape_percent_in_help(parser) -> List[str]:
    """Make ``--help`` work on Megatron's parser: argparse %-formats every help string, and
    megatron-core 0.19's ``--moe-paged-stash-buffer-size-factor-cuda`` help says ``10%)``, so
    stock ``pretrain_gpt.py --help`` dies with ``ValueError: unsupported format character``.
    Every help string that does not format is escaped (``%`` -> ``%%``); the others, and the
    parsing itself, are untouched. Returns the flags whose help was escaped."""
    fixed = []
    for action in getattr(parser, "_actions", []):
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")
            fixed.append(action.option_strings[0] if action.option_strings else action.dest)
    return fixed


def prebuilt_helper_available() -> bool:
    """True when ``megatron.core.datasets.helpers_cpp`` imports (the wheel's compiled helper)."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return True
    except ImportError:
        return False


def build_helper_with_this_python(datasets_dir: str) -> int:
    """Run the dataset helper's ``Makefile`` (a Megatron-LM checkout) for the running
    interpreter; returns make's exit status.

    The Makefile asks ``python3 -m pybind11 --includes`` and ``python3-config
    --extension-suffix``, i.e. whichever ``python3`` is first on PATH, which in a virtual
    environment is often another interpreter without pybind11. The same two values are taken
    from this interpreter (pybind11 is a dependency of loco-megatron) and passed to make.
    """
    import subprocess
    import sysconfig

    import pybind11

    includes = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
    return subprocess.run(["make", "-C", datasets_dir, f"CPPFLAGS={includes}",
                           f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"]).returncode


def skip_helper_build_when_prebuilt() -> None:
    """Make ``compile_helpers()`` a no-op when the compiled dataset helper is importable; in a
    Megatron-LM checkout without it, build it for this interpreter
    (:func:`build_helper_with_this_python`), falling back to megatron's own build."""
    import megatron.core.datasets.utils as dataset_utils

    original = dataset_utils.compile_helpers

    def compile_helpers():
        if prebuilt_helper_available():
            return
        datasets_dir = os.path.dirname(os.path.abspath(dataset_utils.__file__))
        if os.path.isfile(os.path.join(datasets_dir, "Makefile")) and \
                build_helper_with_this_python(datasets_dir) == 0:
            return
        original()

    _replace(dataset_utils, "compile_helpers", compile_helpers, "dataset helper prebuilt or built "
             "for this interpreter")


def skip_jit_warmup() -> None:
    """Replace ``megatron.training.initialize._warmup_jit_function`` with a no-op."""
    import megatron.training.initialize as initialize

    _replace(initialize, "_warmup_jit_function", lambda *args, **kwargs: None, "CPU emulation")


def init_torch_optimizer_states_before_load() -> None:
    """Let ``--load`` work with megatron-core's torch-optimizer fallback (no TE/apex, e.g. CPU).

    Without Transformer Engine or apex, megatron-core's ``DistributedOptimizer`` wraps
    ``torch.optim.AdamW``, whose state (and per-parameter ``step``) is empty until the first
    step; ``DistributedOptimizer.state_dict()`` then fails (``assert len(steps) == 1``) while
    ``load_checkpoint`` builds the state dict to load into. Before loading an existing
    checkpoint, this runs megatron-core's own ``_init_optimizer_states_with_dummy_values()``
    (the call megatron makes itself for some sharding formats); the checkpoint then overwrites
    the dummy states and the parameters. Not with ``--finetune`` / ``--no-load-optim``: the
    optimizer state is not loaded then, and a dummy step would leave Adam one step ahead.
    Stock behaviour everywhere else.
    """
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.training.training as training

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original = training.load_checkpoint

    def load_checkpoint(model, optimizer, *args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        load_dir = margs.load
        loads_optimizer = not (getattr(margs, "finetune", False)
                               or getattr(margs, "no_load_optim", False))
        if optimizer is not None and load_dir and loads_optimizer and os.path.exists(
                os.path.join(load_dir, "latest_checkpointed_iteration.txt")):
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                if isinstance(opt, distrib_optimizer.DistributedOptimizer) and not opt.optimizer.state:
                    with torch.no_grad():
                        opt._init_optimizer_states_with_dummy_values()
        # fp32 training: the distributed optimizer's main params are views of the model's leaf
        # params, which the dp_reshardable loader copies into in place; autograd must be off.
        with torch.no_grad():
            return original(model, optimizer, *args, **kwargs)

    _replace(training, "load_checkpoint", load_checkpoint, "torch AdamW without TE/apex")


def fix_torch_adamw_resume() -> None:
    """Make resuming bit-exact with megatron-core's torch-optimizer fallback (no TE/apex, e.g.
    CPU). Two megatron-core 0.19 defects on that path, both fixed here; stock behaviour when
    TE/apex is present:

    * ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every tensor of the
      optimizer's per-parameter state from the loaded dict, but ``torch.optim.AdamW`` keeps a
      per-parameter ``step`` tensor that megatron-core does not save there, so a ``torch``-format
      (``dp_zero``) load dies with ``KeyError: 'step'``, and a ``dp_reshardable`` load copies
      the *template's* ``step`` back over the loaded one (the resumed run restarts Adam's bias
      correction from 1). Only ``param`` and the saved optimizer-state keys are copied; others
      are passed as None, which megatron-core skips (``step`` comes from the param groups).
    * ``DistributedOptimizer.load_state_dict`` gives every parameter the *same* ``step`` tensor,
      which ``torch.optim.AdamW`` then increments once per parameter per step: after a resume
      the bias correction runs ahead (step 2 -> 19 for 17 parameters). Each parameter gets its
      own copy after the load.
    """
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    set_states, load_state_dict = cls._set_main_param_and_optimizer_states, cls.load_state_dict

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        saved = ("param", *compat.optimizer_state_keys(self))  # never the per-parameter "step"
        current = {"param": main_param, **self.optimizer.state.get(main_param, {})}
        # Keys not saved get their own current tensor (a no-op copy; megatron-core < 0.19
        # copies every key without skipping None), or None where there is none.
        return set_states(self, model_param, {
            k: tensors.get(k) if k in saved else (
                current[k] if isinstance(current.get(k), torch.Tensor) else None)
            for k in set(tensors) | set(current)})

    def untied_load_state_dict(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    _replace(cls, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states,
             "torch AdamW without TE/apex")
    _replace(cls, "load_state_dict", untied_load_state_dict, "torch AdamW without TE/apex")
