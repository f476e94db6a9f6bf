"""One bucket's LoCo error buffer and the checks of its saved form.

The error ``e`` of LoCo's moving average (arXiv 2407.04480, Alg. 1; step 3 in
loco_megatron/algorithm.py) is stored in 8 bits (int8 codes, symmetric, one fp32 scale per block: ~1 byte per element) or exactly in
fp32. :class:`~loco_megatron.compensator.Compensator` holds one per bucket (and per stage of the
hierarchical mode); the checkpoint code validates and decodes saved entries with
:func:`validate_entry` and :func:`decode_entry`.
"""

from typing import Dict, Optional

import torch

from .quantization import dequantize_spans, quantize_spans

#: tensors that hold an error buffer, per ``--loco-error-dtype``
STORAGE_FIELDS = {"int8": ("codes", "scales"), "fp32": ("values",)}


class ErrorBuffer:
    """One bucket's compression error ``e``, stored as int8 + fp32 scale per block, or exact.

    The buffer lies in the bucket's wire layout (loco_megatron/layout.py): element ``i`` is the
    error of the code at wire offset ``i``, and the int8 storage keeps one scale per wire block.
    Blocks may be short, so ``spans`` says how many elements each scale covers.

    Args:
        numel: elements (the bucket's wire length, ``world * padded_shard``).
        block_size: elements per full block.
        storage: ``"int8"`` (1 byte/element + 4 bytes/block) or ``"fp32"`` (exact; fp64 when
            ``dtype`` is fp64, so float64 identities can be tested).
        dtype: working dtype of the values returned by :meth:`get` (fp32 or fp64).
        device: where the buffer lives (the gradient buffer's device).
        spans: int64 ``[nblocks]``, the wire elements of each block in order (summing to
            ``numel``; :attr:`~loco_megatron.kernels.block_table.BlockTable.spans`); default
            ``numel / block_size`` blocks of ``block_size``.

    Raises:
        ValueError: ``spans`` that do not sum to ``numel``, or no ``spans`` and ``numel`` not a
            multiple of ``block_size``.
    """

    def __init__(self, numel: int, block_size: int, storage: str, dtype: torch.dtype, device,
                 spans: Optional[torch.Tensor] = None):
        self.numel, self.block_size, self.storage, self.dtype = numel, block_size, storage, dtype
        if spans is None:
            spans = uniform_spans(numel, block_size)
        elif int(spans.sum()) != numel:
            raise ValueError(f"block spans sum to {int(spans.sum())}, not {numel} elements")
        #: the spans on the host: what a later caller's layout is compared with
        self.host_spans = spans.cpu()
        self.spans = spans.to(device=device, dtype=torch.int64)
        if storage == "int8":
            self.codes = torch.zeros(numel, dtype=torch.int8, device=device)
            self.scales = torch.zeros(spans.numel(), dtype=torch.float32, device=device)
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
        self.spans = self.spans.to(device)

    @property
    def nblocks(self) -> int:
        """Blocks (int8 scales) of the buffer."""
        return self.spans.numel()

    def get(self) -> torch.Tensor:
        """The stored error as a new ``[numel]`` tensor in the working dtype."""
        if self.storage == "int8":
            return dequantize_spans(self.codes, self.scales, self.spans, self.dtype)
        return self.values.clone()

    def set(self, e: torch.Tensor) -> None:
        """Store ``e`` (``[numel]``); int8 storage rounds to within scale/2 per element."""
        if self.storage == "int8":
            codes, scales = quantize_spans(e.float(), self.spans, 8)
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
            codes = self.codes.float()
            per_block = torch.segment_reduce(codes * codes, "sum", lengths=self.spans,
                                             unsafe=True)
            return torch.dot(per_block, self.scales * self.scales)
        return torch.dot(self.values, self.values)

    def nbytes(self) -> int:
        """Bytes held in memory by this buffer."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def uniform_spans(numel: int, block_size: int) -> torch.Tensor:
    """int64 spans of ``numel / block_size`` whole blocks (a layout without short blocks).

    Raises:
        ValueError: ``numel`` not a multiple of ``block_size``.
    """
    if numel % block_size:
        raise ValueError(f"an error buffer of {numel} elements needs its block spans "
                         f"(not a multiple of block {block_size})")
    return torch.full((numel // block_size,), block_size, dtype=torch.int64)


def validate_entry(entry, numel: int, nblocks: int, where: str) -> str:
    """Check a saved error-buffer entry and return its storage (``"int8"`` or ``"fp32"``).

    Args:
        entry: ``{"codes": int8 [numel], "scales": fp32 [nblocks]}`` or
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
    expected = {"codes": (torch.int8, numel), "scales": (torch.float32, nblocks),
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


def decode_entry(entry, spans: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The error values ``[numel]`` of a validated entry, in ``dtype`` (``spans``: its blocks'
    elements, as :class:`ErrorBuffer`)."""
    if "codes" in entry:
        return dequantize_spans(entry["codes"], entry["scales"], spans, dtype)
    return entry["values"].to(dtype)
