"""The one way loco_megatron changes megatron-core, megatron.training or torch at run time.

Every replacement of a class or module attribute goes through a :class:`PatchSet`: it records
what it replaces, restores it exactly (an attribute that did not exist on the owner is deleted
again, so an inherited method is never left shadowed by a copy on the subclass), refuses to be
applied twice, and restores in reverse order. Modelled on TransformerEngine's ``fp8_autocast``
(global state restored in ``finally``) and ``unittest.mock.patch`` (the owner's own ``__dict__``
entry is what is saved).

Users of it: :func:`loco_megatron.install` (the reduce-scatter seam, checkpoint hooks, fp16 loss
scaling), the training-loop glue (iteration-line telemetry, argument hooks, the workarounds of
:mod:`loco_megatron.training.workarounds`) and the CPU emulation of CUDA.

    patches = PatchSet("loco-telemetry")
    patches.wrap(training_module, "training_log", make_wrapper)
    ...
    patches.restore()

or, for a block: ``with PatchSet("name").applied() as patches: patches.replace(...)``.
"""

import contextlib
import logging
from typing import Any, Callable, Dict, List, Tuple

logger = logging.getLogger(__name__)

_MISSING = object()

#: name -> the PatchSet applied under that name (at most one per name)
_ACTIVE: Dict[str, "PatchSet"] = {}


class PatchError(RuntimeError):
    """A patch set applied twice, or an attribute patched twice by one set."""


def active(name: str) -> bool:
    """True while a :class:`PatchSet` called ``name`` is applied (not yet restored)."""
    return name in _ACTIVE


def active_sets() -> List[str]:
    """Names of the applied patch sets, in the order they were created."""
    return list(_ACTIVE)


class PatchSet:
    """Attribute replacements on classes and modules, restored together.

    Creating a set registers it under ``name``; :meth:`restore` unregisters it.

    Args:
        name: unique among the applied sets (e.g. ``"loco"``, ``"loco-workarounds"``).
        strict: :meth:`restore` refuses (changing nothing) when an attribute it replaced was
            replaced again since, by a newer patch set or by anyone else: restoring would throw
            their value away, or a later restore of theirs would bring a stale wrapper back.
            False (the CPU emulation, whose targets are torch internals): restore anyway, with a
            warning.

    Raises:
        PatchError: a set of that name is applied already (double application).
    """

    def __init__(self, name: str, strict: bool = True):
        if name in _ACTIVE:
            raise PatchError(f"patch set {name!r} is already applied; restore it first "
                             f"(loco_megatron applies each of its patch sets once)")
        self.name, self.strict = name, strict
        #: ``(owner, attribute, the owner's own value before or _MISSING, the new value)``
        self._records: List[Tuple[Any, str, Any, Any]] = []
        _ACTIVE[name] = self

    def replace(self, owner: Any, attribute: str, value: Any) -> Any:
        """Set ``owner.attribute`` to ``value`` (a class or a module); returns what
        ``getattr(owner, attribute)`` gave before (possibly inherited).

        Raises:
            PatchError: this set already replaced that attribute, the set was restored, or the
                attribute is a descriptor whose replacement could not be restored exactly (a
                property, staticmethod or classmethod).
        """
        if self._records is None:
            raise PatchError(f"patch set {self.name!r} was restored; create a new one")
        if any(o is owner and a == attribute for o, a, _, _ in self._records):
            raise PatchError(f"patch set {self.name!r} already replaced "
                             f"{_describe(owner)}.{attribute}")
        raw = (vars(owner).get(attribute) if isinstance(owner, type)
               else getattr(type(owner), attribute, None))
        if isinstance(raw, (property, staticmethod, classmethod)):
            raise PatchError(f"patch set {self.name!r}: {_describe(owner)}.{attribute} is a "
                             f"{type(raw).__name__}; patching it is not supported")
        before = getattr(owner, attribute, _MISSING)
        own = vars(owner).get(attribute, _MISSING)
        setattr(owner, attribute, value)
        self._records.append((owner, attribute, own, value))
        return None if before is _MISSING else before

    def wrap(self, owner: Any, attribute: str, factory: Callable[[Any], Any]) -> Any:
        """``replace(owner, attribute, factory(current value))``; returns the new value."""
        value = factory(getattr(owner, attribute))
        self.replace(owner, attribute, value)
        return value

    def restore(self) -> None:
        """Undo every replacement, newest first: the owner's own previous value is set back,
        or the attribute deleted when the owner had none (inherited or absent). Idempotent.

        Raises:
            PatchError: (``strict`` sets) an attribute was replaced again since, by a newer set
                (named: restore it first) or by code outside loco_megatron (undo that first);
                nothing is restored then and the set stays applied.
        """
        if self._records is None:
            return
        moved = [(owner, attribute) for owner, attribute, _, value in self._records
                 if vars(owner).get(attribute, _MISSING) is not value]
        if moved and self.strict:
            raise PatchError(f"patch set {self.name!r} cannot be restored: " + "; ".join(
                f"{_describe(o)}.{a} was replaced again since, by {_holder(o, a)}"
                for o, a in moved) + "; undo that first (patches are undone newest first)")
        records, self._records = self._records, None
        try:
            for owner, attribute, own, value in reversed(records):
                if (owner, attribute) in moved:
                    logger.warning("%s.%s was replaced again after patch set %r; restoring the "
                                   "original anyway", _describe(owner), attribute, self.name)
                if own is _MISSING:
                    if attribute in vars(owner):
                        delattr(owner, attribute)
                else:
                    setattr(owner, attribute, own)
        finally:
            if _ACTIVE.get(self.name) is self:
                del _ACTIVE[self.name]

    @property
    def is_applied(self) -> bool:
        """True until :meth:`restore`."""
        return self._records is not None

    def targets(self) -> List[Tuple[Any, str]]:
        """``(owner, attribute)`` of every replacement, oldest first."""
        return [(o, a) for o, a, _, _ in self._records or []]

    @contextlib.contextmanager
    def applied(self):
        """Yield this set and restore it when the block ends, also when it raises."""
        try:
            yield self
        finally:
            self.restore()


def _holder(owner: Any, attribute: str) -> str:
    """Who holds ``owner.attribute`` now: the applied patch set that set it, or someone else."""
    current = vars(owner).get(attribute, _MISSING)
    for name, patches in _ACTIVE.items():
        if any(o is owner and a == attribute and v is current
               for o, a, _, v in patches._records or []):
            return f"patch set {name!r} (restore it first)"
    return "code outside loco_megatron's patch sets (e.g. a test's mock)"


def _describe(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
