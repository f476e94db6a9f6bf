"""CPU stand-in for CUDA so that megatron-core's CUDA-assuming code runs on CPU tensors with gloo.

docs/architecture.md (CPU emulation of CUDA). megatron-core writes ``device='cuda'``,
``torch.cuda.current_device()``, ``.cuda()``, ``param.type() == 'torch.cuda.FloatTensor'``, CUDA RNG and streams in a few dozen
places. :func:`activate` makes those work on CPU:

* a ``TorchFunctionMode`` maps cuda devices to cpu in factory calls and ``.to()``, makes
  ``.cuda()`` a no-op, reports ``is_cuda`` True and ``torch.cuda.*Tensor`` type names (also
  inside custom autograd Functions' backward, where the engine drops modes);
* ``torch.cuda`` queries, streams, events and memory statistics get CPU stand-ins;
* the "CUDA" RNG is a generator of its own (:data:`CUDA_GENERATOR`), as on a GPU: the device's
  random ops (dropout, bernoulli, factories asked for a cuda device, and every random fill
  inside megatron's ``get_cuda_rng_tracker().fork()``, e.g. GPU-style weight initialisation)
  draw from it, so megatron's RNG tracker (``fork()`` for tensor-parallel dropout
  and initialisation) and checkpointed RNG states behave as on a GPU, and host-side draws (the
  DataLoader's worker seeds, CPU initialisation) do not shift the dropout masks: a resumed run
  draws the same masks as an uninterrupted one. Megatron's "CPU RNG state changed within GPU
  RNG context" warning is filtered (every op runs on the CPU here);
* DataLoader ``pin_memory`` is turned off and ``torch.accelerator`` reports no accelerator
  (the index build of torch is a CUDA build and would ask for the missing driver).

It refuses to activate where a GPU is present: emulation is for tests and CPU runs only.
Limits: torch.compile/dynamo does not trace under the mode (skip JIT warm-up); streams and
events order nothing (work runs at once) but have identity and a current stream
(:mod:`.stream_model`), which :class:`~.stream_log.StreamLog` uses to check a GPU's ordering.
"""

import contextlib
import functools
import logging
import sys

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..patching import PatchSet
from . import stream_model

_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CPU = torch.device("cpu")

#: the emulated device's random generator (``torch.cuda.get_rng_state`` & co. act on it)
CUDA_GENERATOR = torch.Generator()
_F = torch.nn.functional
_I = torch.nn.init
#: random ops that only run on the device in megatron (dropout masks)
_DEVICE_RANDOM_OPS = {
    _F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d, _F.alpha_dropout,
    _F.feature_alpha_dropout, torch.dropout, torch.bernoulli, torch.Tensor.bernoulli_,
}
_RANDOM_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal,
                     torch.rand_like, torch.randn_like, torch.randint_like}
#: random fills that megatron runs on the host (CPU initialisation) or on the device (inside
#: ``get_cuda_rng_tracker().fork()``, e.g. ``_initialize_affine_weight_gpu``)
_FILL_RANDOM_OPS = _RANDOM_FACTORIES | {
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.exponential_,
    _I.normal_, _I.uniform_, _I.trunc_normal_, _I.xavier_normal_, _I.xavier_uniform_,
    _I.kaiming_normal_, _I.kaiming_uniform_, _I.orthogonal_, _I.sparse_,
}


def _is_cuda_device(d) -> bool:
    return to_cpu_device(d) is _CPU and d is not _CPU and not (isinstance(d, str) and d == "cpu")


def _on_device_generator(func, *args, **kwargs):
    """Run a random op with the CPU default generator holding the emulated CUDA state."""
    host = torch.default_generator.get_state()
    torch.default_generator.set_state(CUDA_GENERATOR.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        CUDA_GENERATOR.set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(host)
_IS_CUDA = torch.Tensor.is_cuda  # the getset descriptor (``__get__`` wrappers are new per access)


def to_cpu_device(d):
    """Map a cuda device spec (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda')``, an int) to cpu.

    Anything else (None, ``'cpu'``, ``'meta'``) is returned unchanged.
    """
    if isinstance(d, bool):
        return d
    if isinstance(d, int):
        return _CPU
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    if isinstance(d, torch.device) and d.type == "cuda":
        return _CPU
    return d


class CpuAsCudaMode(TorchFunctionMode):
    """Torch function mode that runs CUDA-addressed tensor code on CPU (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device_random = kwargs.get("generator") is None and (
            func in _DEVICE_RANDOM_OPS or (_state["in_fork"] > 0 and func in _FILL_RANDOM_OPS))
        if "device" in kwargs:
            device_random = device_random or (func in _RANDOM_FACTORIES and kwargs.get(
                "generator") is None and _is_cuda_device(kwargs["device"]))
            kwargs["device"] = to_cpu_device(kwargs["device"])
        if device_random:
            return _on_device_generator(func, *args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if getattr(func, "__self__", None) is _IS_CUDA:  # the is_cuda property getter
            return True
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _TYPE_NAMES.get(name, name)
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros):
            args = tuple(to_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


_Stream, _Event = stream_model.EmulatedStream, stream_model.EmulatedEvent  # the stand-ins


def _rng_warning_filter(record: logging.LogRecord) -> bool:
    return not (is_active() and "CPU RNG state changed within GPU RNG" in record.getMessage())


class _DeviceProperties:
    """Stand-in for ``torch.cuda.get_device_properties()`` (an sm_80-class device)."""

    name = "cpu (CUDA emulation)"
    major, minor = 8, 0
    multi_processor_count = 1
    total_memory = 0


_DEVICE_PROPERTIES = _DeviceProperties()
#: name of the emulation's :class:`~loco_megatron.patching.PatchSet`
PATCH_SET = "loco-cpu-emulation"
_state = {"mode": None, "patches": None, "in_fork": 0}


def is_active() -> bool:
    """True while the emulation is active in this process."""
    return _state["mode"] is not None


def _patch(obj, name, value):
    _state["patches"].replace(obj, name, value)


def activate() -> None:
    """Make CUDA-assuming code run on CPU in this process (idempotent).

    Raises:
        RuntimeError: a real GPU is present (use it instead of the emulation).
    """
    if is_active():
        return
    if torch.cuda.is_available():
        raise RuntimeError("a GPU is present: the CPU emulation of CUDA is for CPU-only machines")
    import torch.cuda.random as cuda_random
    import torch.utils.data as tud

    # not strict: torch may rebind some of these names itself; deactivate always restores
    _state["patches"] = PatchSet(PATCH_SET, strict=False)
    try:
        cuda = torch.cuda
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda *a, **k: None,
            "synchronize": lambda *a, **k: None,
            "empty_cache": lambda: None,
            "Stream": _Stream,
            "Event": _Event,
            "current_stream": stream_model.current_stream,
            "default_stream": stream_model.default_stream,
            "stream": stream_model.stream,
            "is_current_stream_capturing": lambda: False,  # no CUDA graphs (MoE router, dynamo)
            "manual_seed": lambda seed: CUDA_GENERATOR.manual_seed(int(seed)),
            "manual_seed_all": lambda seed: CUDA_GENERATOR.manual_seed(int(seed)),
            "get_rng_state": lambda device="cuda": CUDA_GENERATOR.get_state(),
            "set_rng_state": lambda new_state, device="cuda": CUDA_GENERATOR.set_state(new_state),
            "default_generators": (CUDA_GENERATOR,),
            "_lazy_call": lambda callable, **kwargs: callable(),
            "memory_allocated": lambda *a, **k: 0,
            "max_memory_allocated": lambda *a, **k: 0,
            "memory_reserved": lambda *a, **k: 0,
            "max_memory_reserved": lambda *a, **k: 0,
            "reset_peak_memory_stats": lambda *a, **k: None,
            "get_device_name": lambda *a, **k: "cpu (CUDA emulation)",
            "get_device_capability": lambda *a, **k: (8, 0),
            "get_device_properties": lambda *a, **k: _DEVICE_PROPERTIES,
        }.items():
            _patch(cuda, name, value)
        for name in ("get_rng_state", "set_rng_state", "manual_seed"):
            _patch(cuda_random, name, getattr(cuda, name))
        mcore_random = sys.modules.get("megatron.core.tensor_parallel.random")
        if mcore_random is not None:  # imported before activation: it holds its own _lazy_call
            _patch(mcore_random, "_lazy_call", cuda._lazy_call)
        from ..megatron.compat import tensor_parallel_random_module

        mcore_random = tensor_parallel_random_module()
        if mcore_random is not None:  # random fills inside fork() are device ops
            tracker = mcore_random.CudaRNGStatesTracker
            _patch(tracker, "fork", _counting_fork(tracker.fork))
        logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_rng_warning_filter)
        _patch(torch.accelerator, "current_accelerator", lambda check_available=False: None)
        _patch(torch.accelerator, "is_available", lambda: False)
        loader_init = tud.DataLoader.__init__

        def _loader_init(self, *args, **kwargs):
            kwargs["pin_memory"] = False
            loader_init(self, *args, **kwargs)

        _patch(tud.DataLoader, "__init__", _loader_init)
        _patch(torch.autograd.function.BackwardCFunction, "apply",
               _in_mode(torch.autograd.function.BackwardCFunction.apply))
    except BaseException:  # nothing half-applied
        _state["patches"].restore()
        _state["patches"] = None
        raise
    mode = CpuAsCudaMode()
    mode.__enter__()
    _state["mode"] = mode


def _in_mode(apply):
    """Run a custom autograd Function's backward under the mode: the autograd engine does not
    carry torch function modes into backward, where megatron allocates on
    ``torch.cuda.current_device()`` too (e.g. the MoE token dispatchers' gathers)."""
    @functools.wraps(apply)
    def backward_apply(self, *args):
        if _state["mode"] is None or any(isinstance(m, CpuAsCudaMode)
                                         for m in _get_current_function_mode_stack()):
            return apply(self, *args)
        with CpuAsCudaMode():
            return apply(self, *args)
    return backward_apply


def _counting_fork(fork):
    @contextlib.contextmanager
    def counted(self, *args, **kwargs):
        with fork(self, *args, **kwargs):
            _state["in_fork"] += 1
            try:
                yield
            finally:
                _state["in_fork"] -= 1
    return counted


def deactivate() -> None:
    """Undo :func:`activate` (restores every patched attribute; no-op when inactive)."""
    if not is_active():
        return
    _state["mode"].__exit__(None, None, None)
    _state["mode"] = None
    _state["patches"].restore()  # deletes what did not exist before
    _state["patches"] = None


def activate_if_no_gpu() -> bool:
    """Activate the emulation only on a machine without a usable GPU; returns whether it did."""
    if torch.cuda.is_available():
        return False
    activate()
    return True
