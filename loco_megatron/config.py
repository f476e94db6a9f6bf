"""LoCo configuration: the single source of truth for every LoCo setting.

Modelled on megatron-core's dataclass configs (``DistributedDataParallelConfig``): one docstring
per field, validation in ``__post_init__`` with the flag named in the message. The argparse flags
(``--loco-*``) are generated from the fields by :mod:`loco_megatron.megatron.arguments`.
"""

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

#: Bit widths that run the compressed path. 16 and 32 mean "full precision": LoCo off.
COMPRESSED_BITS = (4, 8)
FULL_PRECISION_BITS = (16, 32)
ERROR_DTYPES = ("int8", "fp32")
#: values of ``--loco-kernels`` (loco_megatron/kernels)
KERNEL_CHOICES = ("auto", "torch", "cpu", "triton")
#: values of ``--loco-intra-node-bits``: 8 (compensated) or 16 (the grad buffer's own precision)
INTRA_NODE_BITS = (8, 16)
#: Largest ``block_size``: blocks are padded at every parameter and shard boundary, so larger
#: blocks only add padding (and a 10^12 block would allocate terabytes).
MAX_BLOCK_SIZE = 65536


#: accepted Python types per field (bool is refused where an int is expected)
_FIELD_TYPES = {"bits": (int, type(None)), "beta": (float, int), "reset_interval": (int,),
                "block_size": (int,), "error_dtype": (str,), "start_iter": (int,),
                "kernels": (str,), "intra_node_bits": (int,)}  # hierarchical: its own check


class LoCoConfigError(ValueError):
    """An invalid LoCo setting; the message names the flag and what to do."""


@dataclass
class LoCoConfig:
    """Settings of the LoCo compensated low-bit reduce-scatter (arXiv 2407.04480, Alg. 1).

    Defaults follow the authors' DeepSpeed implementation (PR #6730): ``err_beta=0.8``,
    ``reset_T=1024``. Raises :class:`LoCoConfigError` on invalid values.
    """

    bits: Optional[int] = None
    """Bits per gradient element on the wire (``--loco-bits``): 4 or 8 compress; 16, 32 or
    None leave megatron-core's full-precision reduce-scatter untouched (LoCo off)."""

    beta: float = 0.8
    """Moving-average factor of the error buffer (``--loco-err-beta``), in [0, 1):
    ``e_t = beta * e_{t-1} + (1 - beta) * (h_t - deQ(Q(h_t)))``. 0 is classic error feedback."""

    reset_interval: int = 1024
    """Zero all error buffers every this many optimizer steps (``--loco-reset-interval``);
    0 never resets. Counted in optimizer steps for all buckets at once."""

    block_size: int = 256
    """Elements per quantization block, each with one fp32 scale (``--loco-block-size``). Even,
    so 4-bit codes pack two per byte; wire overhead is ``32 / block_size`` bits per element."""

    error_dtype: str = "int8"
    """Storage of the error buffer (``--loco-error-dtype``): ``int8`` (symmetric, one fp32 scale
    per block, ~1 byte per element) or ``fp32`` (exact, 4 bytes per element)."""

    start_iter: int = 0
    """Warm-up (``--loco-start-iter``): megatron-core's full-precision reduce-scatter for the
    first this many optimizer steps, LoCo from then on (the precedents: PowerSGD's
    ``start_powerSGD_iter``, 1-bit Adam's ``freeze_step``). Counted with the per-bucket step
    counter that also schedules resets and is saved in checkpoints, so a resumed run continues
    the count; a checkpoint without LoCo state starts it at 0. 0 compresses from the first step."""

    kernels: str = "auto"
    """Implementation of the compress/decompress hot path (``--loco-kernels``): ``auto``
    (Triton for CUDA tensors, the C kernel for CPU tensors, the torch reference where neither
    runs), ``triton``, ``cpu`` or ``torch`` (the reference). All give the same codes and error
    buffers bit for bit (loco_megatron/kernels); not part of the checkpoint fingerprint."""

    hierarchical: bool = False
    """Two-stage reduce-scatter (``--loco-hierarchical``; DESIGN.md §2, docs/hierarchical.md):
    within each node at ``intra_node_bits``, then across nodes at ``bits`` with its own error
    buffer. Nodes are read from the launcher's ``LOCAL_WORLD_SIZE`` (ranks placed contiguously
    per node, as torchrun and Slurm do). The inter-node stage uses ``bits``; with ``bits``
    16/32 (LoCo off) the switch has no effect."""

    intra_node_bits: int = 16
    """Bits per element of the intra-node stage of ``--loco-hierarchical``
    (``--loco-intra-node-bits``): 16 sends the gradient buffer's own dtype (full precision:
    fp32 or bf16) and sums in fp32; 8 sends compensated 8-bit codes with their own error
    buffer. Only used with ``--loco-hierarchical``."""

    def __post_init__(self):
        for name, types in _FIELD_TYPES.items():  # wrong types (Python API, JSON) name the flag
            value = getattr(self, name)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                wanted = " or ".join("None" if t is type(None) else t.__name__ for t in types)
                raise LoCoConfigError(
                    f"--loco-{'err-beta' if name == 'beta' else name.replace('_', '-')} "
                    f"{value!r}: expected {wanted}, got {type(value).__name__}.")
        if self.bits is not None and self.bits not in COMPRESSED_BITS + FULL_PRECISION_BITS:
            raise LoCoConfigError(
                f"--loco-bits {self.bits} is not supported: use 4 or 8 to compress, "
                f"or 16/32 (or leave it unset) for megatron-core's full-precision reduce-scatter."
            )
        if not (0.0 <= float(self.beta) < 1.0):
            raise LoCoConfigError(
                f"--loco-err-beta {self.beta} is outside [0, 1): 0 is plain error feedback, "
                f"0.8 is the paper's default."
            )
        if int(self.reset_interval) != self.reset_interval or self.reset_interval < 0:
            raise LoCoConfigError(
                f"--loco-reset-interval {self.reset_interval} must be a non-negative integer "
                f"(0 = never reset)."
            )
        if int(self.block_size) != self.block_size or not 2 <= self.block_size <= MAX_BLOCK_SIZE \
                or self.block_size % 2:
            raise LoCoConfigError(
                f"--loco-block-size {self.block_size} must be an even integer in "
                f"[2, {MAX_BLOCK_SIZE}] (4-bit codes are packed two per byte; blocks are padded "
                f"at every parameter and shard boundary); 256 is the default."
            )
        if int(self.start_iter) != self.start_iter or self.start_iter < 0:
            raise LoCoConfigError(
                f"--loco-start-iter {self.start_iter} must be a non-negative integer "
                f"(optimizer steps at full precision before LoCo starts; 0 = from the start)."
            )
        if self.kernels not in KERNEL_CHOICES:
            raise LoCoConfigError(
                f"--loco-kernels {self.kernels!r} is not one of {KERNEL_CHOICES} (auto picks "
                f"Triton on GPUs and the C kernel on CPUs)."
            )
        if not isinstance(self.hierarchical, bool):
            raise LoCoConfigError(
                f"--loco-hierarchical takes no value (a switch; 'hierarchical: true' in YAML), "
                f"got {self.hierarchical!r}.")
        if self.intra_node_bits not in INTRA_NODE_BITS:
            raise LoCoConfigError(
                f"--loco-intra-node-bits {self.intra_node_bits} is not one of {INTRA_NODE_BITS}: "
                f"8 compresses the intra-node stage, 16 keeps it at the gradient buffer's "
                f"precision.")
        if self.intra_node_bits != 16 and not self.hierarchical:
            raise LoCoConfigError(
                f"--loco-intra-node-bits {self.intra_node_bits} only applies to the two-stage "
                f"reduce-scatter: add --loco-hierarchical, or drop --loco-intra-node-bits.")
        if self.error_dtype not in ERROR_DTYPES:
            raise LoCoConfigError(
                f"--loco-error-dtype {self.error_dtype!r} is not one of {ERROR_DTYPES}."
            )

    @property
    def enabled(self) -> bool:
        """True when gradients are compressed (bits 4 or 8)."""
        return self.bits in COMPRESSED_BITS

    def to_dict(self) -> Dict[str, Any]:
        """Field name -> value, for logs and checkpoint fingerprints."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
