"""Run a Megatron-LM checkout's own ``pretrain_gpt.py`` with LoCo installed, without forking it.

    python -m torch.distributed.run --nproc-per-node 8 -m loco_megatron.run_megatron_lm \\
        --megatron-lm /path/to/Megatron-LM <pretrain_gpt.py flags> --loco-bits 4

The checkout comes from ``--megatron-lm PATH`` (anywhere on the command line; removed before
Megatron sees the arguments) or the ``MEGATRON_LM`` environment variable. Its directory is put
first on ``sys.path``, so its ``megatron`` package is the one that runs (not an installed
megatron-core wheel), then its ``pretrain_gpt.py`` runs as ``__main__`` (``runpy``) with
``sys.argv`` set to the remaining arguments.

Both entry-point styles of Megatron-LM's ``pretrain_gpt.py`` go through
``megatron/training/arguments.py``'s ``parse_args(extra_args_provider, ignore_unknown_args)``
and then, once the arguments are validated, ``megatron/training/global_vars.py``'s
``set_global_variables(args)``:

* core <= 0.17: ``pretrain(..., extra_args_provider=...)`` -> ``initialize_megatron`` ->
  ``parse_args`` -> ``validate_args`` / ``validate_yaml`` -> ``set_global_variables``;
* core >= 0.18: ``parse_and_validate_args(extra_args_provider=...)`` -> the same three steps,
  then ``pretrain(cfg_container, ...)``.

:func:`loco_megatron.megatron.lm_hooks.enable_loco` hooks those two functions (the patches in
``patches/`` call the same function from the script itself).
"""

import os
import runpy
import sys
from typing import List, Optional, Tuple

from .megatron.lm_hooks import enable_loco

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
        CheckoutError: neither is set, or the directory holds no ``pretrain_gpt.py`` and
            ``megatron/training/arguments.py``.
    """
    source, path = (FLAG, flag_value) if flag_value else (ENV, environ.get(ENV))
    if not path:
        raise CheckoutError(f"no Megatron-LM checkout given: pass {FLAG} PATH or set {ENV}=PATH "
                            f"to the root of your Megatron-LM clone (the directory holding "
                            f"{SCRIPT}).")
    path = os.path.abspath(os.path.expanduser(path))
    missing = [rel for rel in (SCRIPT, os.path.join("megatron", "training", "arguments.py"))
               if not os.path.isfile(os.path.join(path, rel))]
    if missing:
        raise CheckoutError(f"{source} {path} is not a Megatron-LM checkout ({missing[0]} not "
                            f"found): point {source} at the root of a Megatron-LM clone, e.g. "
                            f"`git clone https://github.com/NVIDIA/Megatron-LM`.")
    return path


def use_checkout(path: str) -> None:
    """Put ``path`` first on ``sys.path`` so its ``megatron`` and top-level modules
    (``gpt_builders``, ``model_provider``) are the ones imported.

    Raises:
        CheckoutError: ``megatron.core`` was already imported from somewhere else.
    """
    loaded = sys.modules.get("megatron.core")
    if loaded is not None and not os.path.abspath(loaded.__file__).startswith(path + os.sep):
        raise CheckoutError(f"megatron.core was imported from {loaded.__file__} before the "
                            f"checkout {path} could be used: start the job with "
                            f"`python -m loco_megatron.run_megatron_lm`.")
    sys.path.insert(0, path)


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of ``python -m loco_megatron.run_megatron_lm``; exits 2 with one line on a
    bad checkout path or LoCo flag."""
    from .megatron import startup

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        flag_value, megatron_argv = split_argv(argv)
        checkout = resolve_checkout(flag_value)
        use_checkout(checkout)
    except CheckoutError as e:
        startup.fail(e)
    enable_loco(megatron_argv)
    import megatron.core

    if not os.path.abspath(megatron.core.__file__).startswith(checkout + os.sep):
        startup.fail(CheckoutError(
            f"megatron.core comes from {megatron.core.__file__}, not from the checkout "
            f"{checkout}: does {checkout}/megatron/core/__init__.py exist?"))
    script = os.path.join(checkout, SCRIPT)
    sys.argv = [script, *megatron_argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
