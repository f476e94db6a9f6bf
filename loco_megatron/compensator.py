"""LoCo error compensation: per-bucket error buffers with moving average, resets and int8 storage.

Implements steps 1-4 of LoCo (arXiv 2407.04480, Alg. 1; DESIGN.md §1) for one data-parallel
rank::

    h_t = g_t + e_{t-1}                                   (compensate)
    c_t = Q_b(h_t)                                        (compress; what is sent)
    e_t = beta * e_{t-1} + (1 - beta) * (h_t - deQ(c_t))  (error moving average)
    e   = 0 every ``reset_interval`` optimizer steps      (reset)

Error buffers are keyed by stable ids (e.g. ``(model chunk, buffer, bucket)``), never by tensor
identity, and checked against the bucket's numel, as PyTorch's ``ddp_comm_hooks`` state objects
key their error dicts by bucket index.
"""

import logging
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Tuple

import torch

from .config import LoCoConfig
from .quantization import dequantize_blockwise, pack_codes, quantize_blockwise

logger = logging.getLogger(__name__)


#: tensors that hold an error buffer, per ``--loco-error-dtype``
STORAGE_FIELDS = {"int8": ("codes", "scales"), "fp32": ("values",)}


class ErrorBuffer:
    """One bucket's compression error ``e``, stored as int8 + fp32 scale per block, or exact.

    Args:
        numel: elements (the bucket's padded, shard-aligned length; a multiple of block_size).
        block_size: elements per int8 storage block.
        storage: ``"int8"`` (~1 byte/element + 4 bytes/block) or ``"fp32"`` (exact; fp64 when
            ``dtype`` is fp64, so float64 identities can be tested).
        dtype: working dtype of the values returned by :meth:`get` (fp32 or fp64).
        device: where the buffer lives (the gradient buffer's device).
    """

    def __init__(self, numel: int, block_size: int, storage: str, dtype: torch.dtype, device):
        self.numel, self.block_size, self.storage, self.dtype = numel, block_size, storage, dtype
        if storage == "int8":
            self.codes = torch.zeros(numel, dtype=torch.int8, device=device)
            self.scales = torch.zeros(numel // block_size, dtype=torch.float32, device=device)
        else:
            self.values = torch.zeros(numel, dtype=dtype, device=device)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The stored tensors by field name (:data:`STORAGE_FIELDS`)."""
        return {name: getattr(self, name) for name in STORAGE_FIELDS[self.storage]}

    @property
    def device(self) -> torch.device:
        """Where the stored error lives."""
        return next(iter(self.tensors().values())).device

    def to_(self, device) -> None:
        """Move the stored error to ``device`` in place."""
        for name, t in self.tensors().items():
            setattr(self, name, t.to(device))

    def get(self) -> torch.Tensor:
        """The stored error as a new ``[numel]`` tensor in the working dtype."""
        if self.storage == "int8":
            return dequantize_blockwise(self.codes, self.scales, self.block_size, dtype=self.dtype)
        return self.values.clone()

    def set(self, e: torch.Tensor) -> None:
        """Store ``e`` (``[numel]``); int8 storage rounds to within scale/2 per element."""
        if self.storage == "int8":
            codes, scales = quantize_blockwise(e, 8, self.block_size)
            self.codes.copy_(codes)
            self.scales.copy_(scales)
        else:
            self.values.copy_(e)

    def zero_(self) -> None:
        """Reset to zero (scales too, so a zero block never decodes to NaN)."""
        for t in self.tensors().values():
            t.zero_()

    def nbytes(self) -> int:
        """Bytes held in memory by this buffer."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class CompensatorStats:
    """Counters since construction: calls per key, skipped (non-finite) updates, resets."""

    calls: int = 0
    skipped_nonfinite: int = 0
    resets: int = 0
    steps: Dict[Hashable, int] = field(default_factory=dict)


class Compensator:
    """Holds every bucket's :class:`ErrorBuffer` and applies LoCo steps 1-4.

    Args:
        config: a :class:`~loco_megatron.config.LoCoConfig` with ``bits`` 4 or 8.
    """

    def __init__(self, config: LoCoConfig):
        if not config.enabled:
            raise ValueError(f"Compensator needs bits 4 or 8, got bits={config.bits}")
        self.config = config
        self.errors: Dict[Hashable, ErrorBuffer] = {}
        self.stats = CompensatorStats()

    def _buffer(self, key: Hashable, numel: int, dtype: torch.dtype, device) -> ErrorBuffer:
        buf = self.errors.get(key)
        if buf is None:
            buf = ErrorBuffer(numel, self.config.block_size, self.config.error_dtype, dtype, device)
            self.errors[key] = buf
        elif buf.numel == numel and buf.device != torch.device(device):
            buf.to_(device)  # restored from a checkpoint on another device
        elif buf.numel != numel:
            raise RuntimeError(
                f"LoCo error buffer {key} holds {buf.numel} elements but the bucket now has "
                f"{numel}: the gradient-buffer layout changed after install (bucket size, DP size "
                f"or model changed); call loco_megatron.uninstall() and install() again."
            )
        return buf

    def compress(self, key: Hashable, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Compensate ``g`` with bucket ``key``'s error, encode it, and update the error.

        Args:
            key: stable bucket id.
            g: flat local gradient ``[n]`` (n a multiple of block_size; any float dtype). Not
                modified.

        Returns:
            ``(payload, scales)`` as :func:`loco_megatron.quantization.encode` gives them for ``n``
            elements: uint8 ``[n * bits / 8]``, fp32 ``[n / block_size]``.

        A non-finite compensated gradient is still encoded (the reduced result is then
        non-finite, as with stock communication) but never enters the error buffer.
        """
        cfg = self.config
        work = torch.float64 if g.dtype == torch.float64 else torch.float32
        buf = self._buffer(key, g.numel(), work, g.device)
        step = self.stats.steps.get(key, 0)
        if cfg.reset_interval and step > 0 and step % cfg.reset_interval == 0:
            buf.zero_()
            self.stats.resets += 1
        e_prev = buf.get()
        h = g.to(work) + e_prev
        codes, scales = quantize_blockwise(h, cfg.bits, cfg.block_size)
        scales = scales.float()  # as sent, so the error is measured against what peers decode
        if torch.isfinite(scales).all():
            new_err = h - dequantize_blockwise(codes, scales, cfg.block_size, dtype=work)
            if cfg.beta:
                new_err = cfg.beta * e_prev + (1.0 - cfg.beta) * new_err
            buf.set(new_err)
        else:
            self.stats.skipped_nonfinite += 1
            logger.warning("LoCo: non-finite gradient in bucket %s; error update skipped", key)
        self.stats.steps[key] = step + 1
        self.stats.calls += 1
        return pack_codes(codes, cfg.bits), scales

    def error_bytes(self) -> int:
        """Total bytes of all error buffers on this rank."""
        return sum(b.nbytes() for b in self.errors.values())

    # ---- checkpointing (torchtitan-style ``Stateful``: state_dict / load_state_dict) ----

    def fingerprint(self) -> Dict[str, object]:
        """Settings that must match for saved error buffers to be meaningful."""
        cfg = self.config
        return {"bits": cfg.bits, "block_size": cfg.block_size, "error_dtype": cfg.error_dtype}

    def state_dict(self) -> Dict[str, object]:
        """This rank's LoCo state: fingerprint, per-bucket step counters and error buffers.

        Returns a dict of plain Python values and CPU tensors (``torch.save``-able); error
        buffers as ``{"numel", "codes" int8, "scales" fp32}`` (int8 storage) or
        ``{"numel", "values"}`` (fp32 storage), keyed by the stable bucket ids.
        """
        errors = {}
        for key, buf in self.errors.items():
            errors[key] = {"numel": buf.numel,
                           **{name: t.cpu().clone() for name, t in buf.tensors().items()}}
        return {"version": 1, "fingerprint": self.fingerprint(),
                "steps": dict(self.stats.steps), "errors": errors}

    def load_state_dict(self, state: Dict[str, object], device=None) -> List[str]:
        """Restore :meth:`state_dict` output. Returns the warnings it logged (empty when the
        state was restored exactly).

        Policy: step counters are always restored (resets stay on the same optimizer steps);
        error buffers are reset to zero, with a warning, when bits/block size/storage changed or
        a bucket's numel differs from the saved one.

        Raises:
            ValueError: a malformed entry (missing field, wrong dtype or shape), naming the key.
        """
        notes = []
        self.stats.steps = {k: int(v) for k, v in state.get("steps", {}).items()}
        saved_fp = state.get("fingerprint")
        if saved_fp != self.fingerprint():
            notes.append(f"LoCo settings changed since the checkpoint ({saved_fp} -> "
                         f"{self.fingerprint()}): error buffers reset to zero")
            self.errors.clear()
        else:
            for key, entry in state.get("errors", {}).items():
                notes.extend(self._load_entry(key, entry, device))
        for note in notes:
            logger.warning(note)
        return notes

    def _load_entry(self, key, entry, device) -> List[str]:
        fields = STORAGE_FIELDS[self.config.error_dtype]
        if not isinstance(entry, dict) or "numel" not in entry or any(f not in entry for f in fields):
            raise ValueError(f"LoCo checkpoint entry {key}: expected fields numel, "
                             f"{', '.join(fields)}; got {sorted(entry) if isinstance(entry, dict) else type(entry).__name__}")
        numel = int(entry["numel"])
        current = self.errors.get(key)
        if current is not None and current.numel != numel:
            self.errors.pop(key)
            return [f"LoCo error buffer {key}: checkpoint has {numel} elements, the bucket has "
                    f"{current.numel} (bucket layout changed): reset to zero"]
        expected = {"codes": (torch.int8, numel), "scales": (torch.float32, numel // self.config.block_size),
                    "values": (None, numel)}
        for f in fields:
            dtype, n = expected[f]
            t = entry[f]
            if not isinstance(t, torch.Tensor) or t.numel() != n or (dtype and t.dtype != dtype):
                raise ValueError(f"LoCo checkpoint entry {key}.{f}: expected {n} elements of "
                                 f"{dtype or 'float'}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                                 f"{'' if not isinstance(t, torch.Tensor) else ' ' + str(t.dtype)}")
        dtype = entry["values"].dtype if "values" in entry else torch.float32
        buf = ErrorBuffer(numel, self.config.block_size, self.config.error_dtype,
                          torch.float64 if dtype == torch.float64 else torch.float32,
                          device if device is not None else "cpu")
        for f in fields:
            getattr(buf, f).copy_(entry[f])
        self.errors[key] = buf
        return []
