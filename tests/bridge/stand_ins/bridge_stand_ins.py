"""Stand-ins for Megatron-Bridge's unconditional GPU imports (test environment only).

The product (``loco_megatron``) never imports this: it is on the test ranks' path through
``tests/bridge/stand_ins`` (``sitecustomize.py`` beside it calls :func:`activate` at interpreter
start; tests/bridge/conftest.py puts the folder first on ``PYTHONPATH``). Each stand-in, its
reason and the upstream file that needs it: tests/bridge/stand_ins/README.md.

* ``transformer_engine.pytorch`` for megatron/bridge/peft/lora_layers.py only
  (:class:`_LoraLayersFinder`): that module imports it unconditionally and evaluates
  ``te.ops.Sequential`` in a return annotation, while the rest of the stack (megatron-core's
  ``HAVE_TE`` checks) must keep seeing no Transformer Engine. The stub is in ``sys.modules``
  only while lora_layers' own body runs; its LoRA classes then exist, and any use of a TE class
  in them fails (nothing in a LoCo test uses PEFT).
* ``nvidia_resiliency_ext.__version__``: the package folder beside this file.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

#: the one upstream module that gets the Transformer Engine stub
LORA_LAYERS = "megatron.bridge.peft.lora_layers"
#: what lora_layers imports besides TE: imported before the stub window opens, so that no
#: other module ever sees the stub
LORA_LAYERS_DEPS = ("megatron.core.transformer.moe.moe_utils",
                    "megatron.bridge.peft.adapter_wrapper", "megatron.bridge.peft.lora_merge")


class _Anything(types.ModuleType):
    """A stub module whose every attribute is a further stub (``te.ops.Sequential``); a class
    when called for, so ``isinstance(x, te.Linear)`` is simply False."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__}) if name[:1].isupper() \
            else _Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubWindowLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        for dep in LORA_LAYERS_DEPS:
            importlib.import_module(dep)
        te = _Anything("transformer_engine")
        stubs = {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch}
        saved = {name: sys.modules.get(name) for name in stubs}
        sys.modules.update(stubs)
        try:
            self.loader.exec_module(module)
        finally:
            for name, old in saved.items():
                if old is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = old


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    """Finds megatron/bridge/peft/lora_layers.py as usual and runs it with the TE stub."""

    def find_spec(self, fullname, path, target=None):
        if fullname != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _StubWindowLoader(spec.loader)
        return spec


def activate() -> None:
    """Install the stand-ins in this process (idempotent)."""
    if not any(isinstance(f, _LoraLayersFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())
