"""Triton's own key of a kernel launch, and a recorder of the keys LoCo launches.

A Triton ``@jit`` function compiles one binary per key: its argument types and specializations
(an int equal to 1 becomes a constexpr, a pointer or int divisible by 16 gets an attribute, an
int from 2^31 is ``i64``), its constexprs and its options (``num_warps``, ...). A new key in the
middle of a run is a JIT compile on every rank at once. :func:`launch_key` computes the key as
``triton/runtime/jit.py`` does (``create_function_from_signature``, the ``binder`` of
``JITFunction.run``), with an sm_90 backend, so it works without a GPU and under
``TRITON_INTERPRET=1`` (where ``@triton.jit`` gives an ``InterpretedFunction`` and compiles
nothing). :func:`recording` collects the keys of every launch of LoCo's kernels
(:mod:`.triton_kernels` calls :func:`note`): the test that a run's variants are fixed after its
first step (tests/distributed/test_kernels.py) compares them step by step.
"""

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

#: the keys being recorded (``(kernel name, key)`` per launch), or None
_RECORD: Optional[List[Tuple[str, str]]] = None
_BINDERS: Dict[str, object] = {}


def _binder(kernel, not_specialized: Sequence[str]):
    """Triton's binder of ``kernel`` (a ``JITFunction`` or an ``InterpretedFunction``)."""
    fn = kernel.fn  # the Python function (JITFunction and InterpretedFunction alike)
    name = fn.__name__
    if name not in _BINDERS:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        jit = JITFunction(fn, do_not_specialize=list(not_specialized))
        backend = make_backend(GPUTarget("cuda", 90, 64))
        _BINDERS[name] = create_function_from_signature(jit.signature, jit.params, backend)
    return name, _BINDERS[name]


def launch_key(kernel, not_specialized: Sequence[str], args: Sequence, kwargs: Dict) -> str:
    """The key Triton compiles ``kernel(*args, **kwargs)`` under: argument types and
    specializations, constexprs, options (``triton/runtime/jit.py``: ``compute_cache_key``).

    Args:
        kernel: a ``@triton.jit`` kernel.
        not_specialized: its ``do_not_specialize`` argument names (as it was decorated).
        args, kwargs: the launch's arguments (tensors, ints, floats; constexprs and options
            by keyword).

    Returns:
        ``"<kernel name> <specialization> <options>"``: equal for two launches exactly when
        Triton runs them from the same binary.
    """
    name, binder = _binder(kernel, not_specialized)
    _, specialization, options = binder(*args, **kwargs)
    return f"{name} {specialization} {sorted(options.items())}"


def note(kernel, not_specialized: Sequence[str], args: Sequence, kwargs: Dict) -> None:
    """Record the launch's key while :func:`recording` (nothing otherwise: one check)."""
    if _RECORD is not None:
        _RECORD.append(launch_key(kernel, not_specialized, args, kwargs))


@contextlib.contextmanager
def recording():
    """``with recording() as keys:`` every launch of LoCo's Triton kernels appends its
    :func:`launch_key` to ``keys`` (a list, in launch order)."""
    global _RECORD
    previous, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = previous
