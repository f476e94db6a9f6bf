"""Run a Megatron-LM checkout's own ``pretrain_gpt.py`` with LoCo installed, without forking it.

    python -m torch.distributed.run --nproc-per-node 8 -m loco_megatron.training.run_megatron_lm \\
        --megatron-lm /path/to/Megatron-LM <pretrain_gpt.py flags> --loco-bits 4

The checkout comes from ``--megatron-lm PATH`` (anywhere on the command line; removed before
Megatron sees the arguments) or the ``MEGATRON_LM`` environment variable. Its directory is put
first on ``sys.path``, so its ``megatron`` package is the one that runs (not an installed
megatron-core wheel; a directory holding only ``pretrain_gpt.py`` and its helper modules runs the
installed megatron-core >= 0.17), then its ``pretrain_gpt.py`` runs as ``__main__`` (``runpy``)
with ``sys.argv`` set to the remaining arguments. Rank 0 prints which megatron-core runs.

Both entry-point styles of Megatron-LM's ``pretrain_gpt.py`` go through
``megatron/training/arguments.py``'s ``parse_args(extra_args_provider, ignore_unknown_args)``
and then, once the arguments are validated, ``megatron/training/global_vars.py``'s
``set_global_variables(args)``:

* core <= 0.17: ``pretrain(..., extra_args_provider=...)`` -> ``initialize_megatron`` ->
  ``parse_args`` -> ``validate_args`` / ``validate_yaml`` -> ``set_global_variables``;
* core >= 0.18: ``parse_and_validate_args(extra_args_provider=...)`` -> the same three steps,
  then ``pretrain(cfg_container, ...)``.

:func:`loco_megatron.training.argument_hooks.enable_loco` hooks those two functions (the patches in
``patches/`` call the same function from the script itself).
"""

import importlib.util
import os
import runpy
import sys
from typing import List, Optional, Tuple

from .argument_hooks import enable_loco

FLAG = "--megatron-lm"
ENV = "MEGATRON_LM"
SCRIPT = "pretrain_gpt.py"


class CheckoutError(ValueError):
    """The Megatron-LM checkout is missing or is not one; the message says what to do."""


def split_argv(argv: List[str]) -> Tuple[Optional[str], List[str]]:
    """``(checkout path from --megatron-lm or None, the other arguments in order)``.

    Raises:
        CheckoutError: ``--megatron-lm`` without a value.
    """
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise CheckoutError(f"{FLAG} needs a value: the directory of your Megatron-LM "
                                    f"clone (the one holding {SCRIPT}).")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith(FLAG + "="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def resolve_checkout(flag_value: Optional[str], environ=os.environ) -> str:
    """Absolute path of the Megatron-LM checkout: ``--megatron-lm`` wins over ``MEGATRON_LM``.

    Raises:
        CheckoutError: neither is set, or the directory holds no ``pretrain_gpt.py``.
    """
    source, path = (FLAG, flag_value) if flag_value else (ENV, environ.get(ENV))
    if not path:
        raise CheckoutError(f"no Megatron-LM checkout given: pass {FLAG} PATH or set {ENV}=PATH "
                            f"to the root of your Megatron-LM clone (the directory holding "
                            f"{SCRIPT}).")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(path, SCRIPT)):
        raise CheckoutError(f"{source} {path} is not a Megatron-LM checkout ({SCRIPT} not "
                            f"found there): point {source} at the root of your Megatron-LM "
                            f"clone, e.g. of `git clone https://github.com/NVIDIA/Megatron-LM`.")
    return path


def has_own_megatron(path: str) -> bool:
    """True when the checkout holds a ``megatron`` package (a full Megatron-LM clone); a
    directory with only the scripts runs the installed megatron-core (>= 0.17 wheels ship
    ``megatron.training``)."""
    return os.path.isfile(os.path.join(path, "megatron", "core", "__init__.py"))


def use_checkout(path: str) -> None:
    """Put ``path`` first on ``sys.path`` so its ``megatron`` and top-level modules
    (``gpt_builders``, ``model_provider``) are the ones imported.

    Raises:
        CheckoutError: ``megatron.core`` was already imported from somewhere else.
    """
    loaded = sys.modules.get("megatron.core")
    elsewhere = loaded is not None and not os.path.abspath(loaded.__file__).startswith(path + os.sep)
    if elsewhere and has_own_megatron(path):
        raise CheckoutError(f"megatron.core was imported from {loaded.__file__} before the "
                            f"checkout {path} could be used: start the job with "
                            f"`python -m loco_megatron.training.run_megatron_lm`.")
    sys.path.insert(0, path)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of ``python -m loco_megatron.training.run_megatron_lm``; exits 2 with one line on a
    bad checkout path or LoCo flag."""
    from . import startup

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        flag_value, megatron_argv = split_argv(argv)
        checkout = resolve_checkout(flag_value)
        use_checkout(checkout)
    except CheckoutError as e:
        startup.fail(e)
    if not _importable("megatron.training"):
        startup.fail(CheckoutError(
            f"no megatron.training: {checkout} has no megatron/ package and the installed "
            f"megatron-core has none (wheels before 0.17): use a full Megatron-LM clone as "
            f"{FLAG} / {ENV}."))
    script = os.path.join(checkout, SCRIPT)
    sys.argv = [script, *megatron_argv]
    enable_loco()  # expands --config FILE in sys.argv, checks the --loco-* flags
    import megatron.core

    origin = os.path.dirname(os.path.abspath(megatron.core.__file__))
    if has_own_megatron(checkout) and not origin.startswith(checkout + os.sep):
        startup.fail(CheckoutError(
            f"megatron.core comes from {origin}, not from the checkout {checkout}: start the job "
            f"with `python -m loco_megatron.training.run_megatron_lm` and nothing importing megatron "
            f"before it."))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"> LoCo wrapper: running {os.path.join(checkout, SCRIPT)} with megatron-core "
              f"{megatron.core.package_info.__version__} from {origin}", flush=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
