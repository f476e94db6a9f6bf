"""One bucket's LoCo error buffer and the checks of its saved form.

The error ``e`` of LoCo's moving average (arXiv 2407.04480, Alg. 1; step 3 in
loco_megatron/algorithm.py) is stored in 8 bits (int8 codes, symmetric, one fp32 scale per block: ~1 byte per element) or exactly in
fp32. :class:`~loco_megatron.compensator.Compensator` holds one per bucket (and per stage of the
hierarchical mode); the checkpoint code validates and decodes saved entries with
:func:`validate_entry` and :func:`decode_entry`.
"""

from typing import Dict

import torch

from .quantization import dequantize_blockwise, quantize_blockwise

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

    def mul_(self, factor: torch.Tensor) -> None:
        """Multiply the stored error by ``factor`` (a one-element tensor, any device) in place,
        without a host sync: int8 storage scales the per-block fp32 scales (the codes stay),
        fp32/fp64 storage the values. Exact for powers of two while no scale leaves the range."""
        t = self.scales if self.storage == "int8" else self.values
        t.mul_(factor.reshape(()).to(device=t.device, dtype=t.dtype))

    def squared_norm(self) -> torch.Tensor:
        """0-dim ``||e||^2`` of the stored error (int8: of ``codes * scale``), on its device, in
        fp32 (fp64 for fp64 storage), within fp32 rounding; no host sync. int8 storage computes
        ``||(||codes_b|| * scale_b)_b||^2`` from a transient fp32 copy of the codes."""
        if self.storage == "int8":
            codes = self.codes.view(-1, self.block_size).float()
            per_block = torch.linalg.vector_norm(codes, dim=1)
            return torch.linalg.vector_norm(per_block * self.scales).square()
        return torch.dot(self.values, self.values)

    def nbytes(self) -> int:
        """Bytes held in memory by this buffer."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def validate_entry(entry, numel: int, block_size: int, where: str) -> str:
    """Check a saved error-buffer entry and return its storage (``"int8"`` or ``"fp32"``).

    Args:
        entry: ``{"codes": int8 [numel], "scales": fp32 [numel / block_size]}`` or
            ``{"values": float [numel]}`` (extra keys such as ``numel`` are ignored).
        where: names the entry in error messages (checkpoint file and key).

    Raises:
        ValueError: neither field set present, or a field of the wrong dtype or length.
    """
    if not isinstance(entry, dict):
        raise ValueError(f"LoCo checkpoint {where}: expected a dict of tensors, got "
                         f"{type(entry).__name__}")
    storage = next((s for s, fields in STORAGE_FIELDS.items() if all(f in entry for f in fields)),
                   None)
    if storage is None:
        raise ValueError(f"LoCo checkpoint {where}: expected fields codes, scales (int8 storage) "
                         f"or values (fp32 storage); got {sorted(entry)}")
    expected = {"codes": (torch.int8, numel), "scales": (torch.float32, numel // block_size),
                "values": (None, numel)}
    for name in STORAGE_FIELDS[storage]:
        dtype, n = expected[name]
        t = entry[name]
        if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n
                or (dtype is not None and t.dtype != dtype)
                or (dtype is None and not t.is_floating_point())):
            got = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"LoCo checkpoint {where}.{name}: expected {n} elements of "
                             f"{dtype or 'a float dtype'}, got {got}")
    return storage


def decode_entry(entry, block_size: int, dtype=torch.float32) -> torch.Tensor:
    """The error values ``[numel]`` of a validated entry, in ``dtype``."""
    if "codes" in entry:
        return dequantize_blockwise(entry["codes"], entry["scales"], block_size, dtype=dtype)
    return entry["values"].to(dtype)
