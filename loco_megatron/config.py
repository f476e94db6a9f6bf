"""LoCo configuration: the single source of truth for every LoCo setting.

Modelled on megatron-core's dataclass configs (``DistributedDataParallelConfig``): one docstring
per field, validation in ``__post_init__`` with the flag named in the message. Each field also
carries a :class:`Setting` in its metadata (the settings registry, :data:`SETTINGS`): its
``--loco-*`` flag and one-line help, whether the ranks of a data-parallel group must agree on it
and what a change means for a checkpoint's error buffers. Everything else is derived from it:
the argparse flags (:mod:`loco_megatron.cli.flags`), the YAML ``loco:`` keys
(:mod:`loco_megatron.cli.yaml_config`), the start-up agreement check
(:mod:`loco_megatron.agreement`), the checkpoint fingerprint and resume decisions
(:mod:`loco_megatron.megatron.checkpoint.state`) and the flag names in messages.
"""

import typing
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Tuple

#: Bit widths that run the compressed path. 16 and 32 mean "full precision": LoCo off.
COMPRESSED_BITS = (4, 8)
FULL_PRECISION_BITS = (16, 32)
ERROR_DTYPES = ("int8", "fp32")
#: values of ``--loco-grid``: the quantizer's code grid (loco_megatron/quantization.py)
GRIDS = ("symmetric", "full-range")
#: values of ``--loco-kernels`` (loco_megatron/kernels)
KERNEL_CHOICES = ("auto", "torch", "cpu", "triton")
#: values of ``--loco-intra-node-bits``: 8 (compensated) or 16 (the grad buffer's own precision)
INTRA_NODE_BITS = (8, 16)
#: Largest ``block_size``: the fused kernels work on one block at a time (a C workspace of
#: ``3 * block`` floats, a Triton tile of ``block / 2`` lanes), and past a parameter's size a
#: larger block changes nothing (a segment's last block is short).
MAX_BLOCK_SIZE = 65536


#: what a changed value means for a checkpoint's saved error buffers (``Setting.checkpoint``)
RESET, CONVERT, RECORD = "reset", "convert", "record"


class LoCoConfigError(ValueError):
    """An invalid LoCo setting; the message names the flag and what to do."""


@dataclass(frozen=True)
class Setting:
    """Registry entry of one :class:`LoCoConfig` field (``dataclasses.field`` metadata).

    Attributes:
        flag: the command-line flag, ``--loco-...``; the YAML ``loco:`` key is the flag without
            ``--loco-`` (``err-beta``, also ``err_beta``).
        help: one line for ``--help`` (the field's docstring has the details).
        shared: every rank of a data-parallel group must hold the same value (checked at
            start-up by :func:`loco_megatron.agreement.check_layouts_agree`); False for local
            choices that give the same bits (``kernels``).
        checkpoint: None when the value is not part of the checkpoint fingerprint; else what a
            value different from the saved one does on resume: ``"reset"`` (error buffers start
            from zero), ``"convert"`` (saved errors converted), ``"record"`` (saved for the
            record, no effect).
        argparse: extra ``add_argument`` keywords (``metavar``, ``choices``, ``action``).
    """

    flag: str
    help: str
    shared: bool
    checkpoint: Optional[str]
    argparse: Tuple[Tuple[str, Any], ...] = ()

    @property
    def yaml_key(self) -> str:
        """The ``loco:`` section key (``--loco-err-beta`` -> ``err-beta``)."""
        return self.flag[len("--loco-"):]


def _setting(default, flag: str, help: str, *, shared: bool, checkpoint: Optional[str],
             **argparse_kwargs):
    return field(default=default, metadata={"loco": Setting(
        flag, help, shared, checkpoint, tuple(argparse_kwargs.items()))})


@dataclass
class LoCoConfig:
    """Settings of the LoCo compensated low-bit reduce-scatter (arXiv 2407.04480, Alg. 1).

    Defaults follow the authors' DeepSpeed implementation (PR #6730): ``err_beta=0.8``,
    ``reset_T=1024``. Raises :class:`LoCoConfigError` on invalid values.
    """

    bits: Optional[int] = _setting(
        None, "--loco-bits", "bits per gradient element: 4 or 8 compress; 16/32 or unset: LoCo off",
        shared=True, checkpoint=RESET, metavar="{4,8,16,32}")
    """Bits per gradient element on the wire (``--loco-bits``): 4 or 8 compress; 16, 32 or
    None leave megatron-core's full-precision reduce-scatter untouched (LoCo off)."""

    beta: float = _setting(
        0.8, "--loco-err-beta", "moving-average factor of the error buffer, in [0, 1)",
        shared=True, checkpoint=RECORD, metavar="BETA")
    """Moving-average factor of the error buffer (``--loco-err-beta``), in [0, 1):
    ``e_t = beta * e_{t-1} + (1 - beta) * (h_t - deQ(Q(h_t)))``. 0 is classic error feedback."""

    reset_interval: int = _setting(
        1024, "--loco-reset-interval", "zero the error buffers every STEPS steps (0: never)",
        shared=True, checkpoint=RECORD, metavar="STEPS")
    """Zero all error buffers every this many optimizer steps (``--loco-reset-interval``);
    0 never resets. Counted in optimizer steps for all buckets at once."""

    block_size: int = _setting(
        256, "--loco-block-size", "elements per quantization block (even, one fp32 scale)",
        shared=True, checkpoint=RESET, metavar="N")
    """Elements per quantization block, each with one fp32 scale (``--loco-block-size``). Even,
    so 4-bit codes pack two per byte; wire overhead is ``32 / block_size`` bits per element."""

    grid: str = _setting(
        "symmetric", "--loco-grid",
        "quantizer grid: symmetric (4-bit scale absmax/7) or full-range (/8)",
        shared=True, checkpoint=RESET, choices=GRIDS)
    """Code grid of the gradient quantizer ``Q_b`` (``--loco-grid``;
    :mod:`loco_megatron.quantization`): ``symmetric`` (``scale = absmax / (2^(b-1) - 1)``, codes
    in practice ``[-7, 7]`` for 4 bits: 15 levels, every element within half a step) or
    ``full-range`` (``scale = absmax / 2^(b-1)``, codes ``[-8, 7]``: 16 levels and a finer step,
    but a positive absmax element is clipped to code 7, 7/8 of its value; the error buffer
    carries the rest), as the DeepSpeed LoCo kernel quantizes. Same wire bytes either way.
    Applies to the gradient codes on the wire (both stages of ``--loco-hierarchical``), not to
    the error buffer's int8 storage nor to the weight differences of ``--loco-param-bits``
    (always symmetric). A change resets a checkpoint's error buffers on resume."""

    error_dtype: str = _setting(
        "int8", "--loco-error-dtype", "error-buffer storage: int8 (+ block scales) or fp32",
        shared=True, checkpoint=CONVERT, choices=ERROR_DTYPES)
    """Storage of the error buffer (``--loco-error-dtype``): ``int8`` (symmetric, one fp32 scale
    per block, ~1 byte per element) or ``fp32`` (exact, 4 bytes per element)."""

    start_iter: int = _setting(
        0, "--loco-start-iter", "full-precision steps before LoCo starts (0: from the start)",
        shared=True, checkpoint=None, metavar="STEPS")
    """Warm-up (``--loco-start-iter``): megatron-core's full-precision reduce-scatter for the
    first this many optimizer steps, LoCo from then on (the precedents: PowerSGD's
    ``start_powerSGD_iter``, 1-bit Adam's ``freeze_step``). Counted with the per-bucket step
    counter that also schedules resets and is saved in checkpoints, so a resumed run continues
    the count; a checkpoint without LoCo state starts it at 0. 0 compresses from the first step."""

    kernels: str = _setting(
        "auto", "--loco-kernels", "compress kernels: auto, torch (reference), cpu or triton",
        shared=False, checkpoint=None, choices=KERNEL_CHOICES)
    """Implementation of the compress/decompress hot path (``--loco-kernels``): ``auto``
    (Triton for CUDA tensors, the C kernel for CPU tensors, the torch reference where neither
    runs), ``triton``, ``cpu`` or ``torch`` (the reference). All give the same codes and error
    buffers bit for bit (loco_megatron/kernels); not part of the checkpoint fingerprint."""

    hierarchical: bool = _setting(
        False, "--loco-hierarchical", "two-stage reduce-scatter: intra-node, then inter-node",
        shared=True, checkpoint=None)
    """Two-stage reduce-scatter (``--loco-hierarchical``; docs/hierarchical.md):
    within each node at ``intra_node_bits``, then across nodes at ``bits`` with its own error
    buffer. Nodes are read from the launcher's ``LOCAL_WORLD_SIZE`` (ranks placed contiguously
    per node, as torchrun and Slurm do). The inter-node stage uses ``bits``; with ``bits``
    16/32 (LoCo off) the switch has no effect."""

    intra_node_bits: int = _setting(
        16, "--loco-intra-node-bits", "bits of the intra-node stage of --loco-hierarchical",
        shared=True, checkpoint=None, choices=INTRA_NODE_BITS)
    """Bits per element of the intra-node stage of ``--loco-hierarchical``
    (``--loco-intra-node-bits``): 16 sends the gradient buffer's own dtype (full precision:
    fp32 or bf16) and sums in fp32; 8 sends compensated 8-bit codes with their own error
    buffer. Only used with ``--loco-hierarchical``."""

    full_precision_1d: bool = _setting(
        False, "--loco-full-precision-1d",
        "reduce 1-D parameters' gradients (norms, biases) at full precision",
        shared=True, checkpoint=RESET)
    """Send the gradients of 1-D parameters (LayerNorm/RMSNorm weights, biases) at full
    precision (``--loco-full-precision-1d``), as the authors' DeepSpeed LoCo path does: their
    segments leave the compressed layout and go through megatron's own reduce-scatter of the
    gradient buffer's dtype, in a lane of their own (loco_megatron/layout.py); no error buffer
    for them. Flat mode only (refused with ``--loco-hierarchical``)."""

    param_bits: Optional[int] = _setting(
        None, "--loco-param-bits",
        "bits per weight difference in the parameter all-gather: 4 or 8",
        shared=True, checkpoint=RECORD, metavar="{4,8}")
    """Bits per element of the distributed optimizer's parameter all-gather
    (``--loco-param-bits``; docs/param_gather.md): 4 or 8 send each DP shard's weight
    difference ``Q(new - held)`` in blocks of ``block_size`` and every replica adds its
    dequantized value to the parameters it holds (replicas stay bit-identical, the fp32 main
    parameters exact); None, 16 or 32 leave megatron-core's all-gather untouched. Independent of
    ``bits``."""

    def __post_init__(self):
        for name, types in _ACCEPTED_TYPES.items():  # wrong types (Python API, JSON): flag named
            value = getattr(self, name)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                wanted = " or ".join("None" if t is type(None) else t.__name__ for t in types)
                raise LoCoConfigError(
                    f"{flag(name)} {value!r}: expected {wanted}, got {type(value).__name__}.")
        if self.bits is not None and self.bits not in COMPRESSED_BITS + FULL_PRECISION_BITS:
            raise LoCoConfigError(
                f"{flag('bits')} {self.bits} is not supported: use 4 or 8 to compress, "
                f"or 16/32 (or leave it unset) for megatron-core's full-precision reduce-scatter."
            )
        if not 0.0 <= self.beta < 1.0:
            raise LoCoConfigError(
                f"{flag('beta')} {self.beta} is outside [0, 1): 0 is plain error feedback, "
                f"0.8 is the paper's default."
            )
        if self.reset_interval < 0:
            raise LoCoConfigError(
                f"{flag('reset_interval')} {self.reset_interval} must be a non-negative integer "
                f"(0 = never reset)."
            )
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE or self.block_size % 2:
            raise LoCoConfigError(
                f"{flag('block_size')} {self.block_size} must be an even integer in "
                f"[2, {MAX_BLOCK_SIZE}] (4-bit codes are packed two per byte; blocks are cut "
                f"at every parameter and shard boundary); 256 is the default."
            )
        if self.grid not in GRIDS:
            raise LoCoConfigError(
                f"{flag('grid')} {self.grid!r} is not one of {GRIDS} (symmetric: scale "
                f"absmax/7 for 4 bits; full-range: absmax/8, DeepSpeed's LoCo kernel).")
        if self.start_iter < 0:
            raise LoCoConfigError(
                f"{flag('start_iter')} {self.start_iter} must be a non-negative integer "
                f"(optimizer steps at full precision before LoCo starts; 0 = from the start)."
            )
        if self.kernels not in KERNEL_CHOICES:
            raise LoCoConfigError(
                f"{flag('kernels')} {self.kernels!r} is not one of {KERNEL_CHOICES} (auto picks "
                f"Triton on GPUs and the C kernel on CPUs)."
            )
        if not isinstance(self.hierarchical, bool):
            raise LoCoConfigError(
                f"{flag('hierarchical')} takes no value (a switch; 'hierarchical: true' in YAML), "
                f"got {self.hierarchical!r}.")
        if self.intra_node_bits not in INTRA_NODE_BITS:
            raise LoCoConfigError(
                f"{flag('intra_node_bits')} {self.intra_node_bits} is not one of "
                f"{INTRA_NODE_BITS}: "
                f"8 compresses the intra-node stage, 16 keeps it at the gradient buffer's "
                f"precision.")
        if self.intra_node_bits != 16 and not self.hierarchical:
            raise LoCoConfigError(
                f"{flag('intra_node_bits')} {self.intra_node_bits} only applies to the two-stage "
                f"reduce-scatter: add {flag('hierarchical')}, or drop {flag('intra_node_bits')}.")
        if not isinstance(self.full_precision_1d, bool):
            raise LoCoConfigError(
                f"{flag('full_precision_1d')} takes no value (a switch; 'full-precision-1d: "
                f"true' in YAML), got {self.full_precision_1d!r}.")
        if self.full_precision_1d and self.hierarchical:
            raise LoCoConfigError(
                f"{flag('full_precision_1d')} is not supported with {flag('hierarchical')} (its "
                f"two stages have no full-precision lane); drop one of them.")
        if self.param_bits is not None and self.param_bits not in (COMPRESSED_BITS
                                                                   + FULL_PRECISION_BITS):
            raise LoCoConfigError(
                f"{flag('param_bits')} {self.param_bits} is not supported: use 4 or 8 to send "
                f"weight differences, or leave it unset (16/32) for megatron-core's all-gather.")
        if self.error_dtype not in ERROR_DTYPES:
            raise LoCoConfigError(
                f"{flag('error_dtype')} {self.error_dtype!r} is not one of {ERROR_DTYPES}."
            )

    @property
    def enabled(self) -> bool:
        """True when gradients are compressed (bits 4 or 8)."""
        return self.bits in COMPRESSED_BITS

    @property
    def params_enabled(self) -> bool:
        """True when the parameter all-gather sends weight differences (param_bits 4 or 8)."""
        return self.param_bits in COMPRESSED_BITS

    def to_dict(self) -> Dict[str, Any]:
        """Field name -> value, for logs and checkpoint fingerprints."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: field name -> :class:`Setting`, in field order: the settings registry
SETTINGS: Dict[str, Setting] = {f.name: f.metadata["loco"] for f in fields(LoCoConfig)}
#: field name -> its resolved annotation (read once: every LoCoConfig checks its types)
_HINTS = typing.get_type_hints(LoCoConfig)


def flag(name: str) -> str:
    """The ``--loco-*`` flag of field ``name`` (for messages)."""
    return SETTINGS[name].flag


def value_type(name: str) -> type:
    """The Python type of field ``name``'s values, from its annotation (``Optional[int]`` ->
    ``int``): the argparse ``type`` and the YAML conversion."""
    hint = _HINTS[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _accepted_types() -> Dict[str, Tuple[type, ...]]:
    """Field -> accepted Python types (``None`` where the annotation is Optional, an int where a
    float is expected); bool fields have their own check (a switch)."""
    out = {}
    for name in SETTINGS:
        hint, typ = _HINTS[name], value_type(name)
        if typ is bool:
            continue
        types = (typ, int) if typ is float else (typ,)
        out[name] = types + ((type(None),) if type(None) in typing.get_args(hint) else ())
    return out


#: what ``LoCoConfig.__post_init__`` checks each field's type against
_ACCEPTED_TYPES = _accepted_types()


#: why ``--calculate-per-token-loss`` is refused (with LoCo on)
PER_TOKEN_LOSS = (
    "--loco-bits cannot be used with --calculate-per-token-loss: megatron divides the gradients "
    "by the step's token count only after the reduce-scatter (finalize_model_grads, "
    "megatron/core/distributed/finalize_model_grads.py), so the compression error LoCo carries "
    "into the next step is in the units of a step whose count is not known yet when that step "
    "is compressed (with overlap, during its backward); drop --calculate-per-token-loss (the "
    "per-micro-batch mean loss) or LoCo.")


#: what ``--loco-param-bits`` (weight differences, loco_megatron/weight_difference.py) cannot
#: replace: megatron settings whose parameter all-gather (or fp32 main parameters) is not the
#: distributed optimizer's, ``(attribute, what it is, why)``; checked by the preflight
#: (Megatron-LM's arguments) and by the seam (megatron-core's DDP and optimizer configs). The
#: attribute is the same on megatron-core's ``DistributedDataParallelConfig`` /
#: ``OptimizerConfig`` and on Megatron-LM's parsed arguments; ``what`` is the Megatron-LM flag
#: where there is one.
PARAM_BITS_CONFLICTS = tuple(
    [(attr, flag_, "FSDP gathers parameters its own way, not through the distributed "
                   "optimizer's all-gather that LoCo compresses")
     for attr, flag_ in (("use_megatron_fsdp", "--use-megatron-fsdp"),
                         ("use_custom_fsdp", "--use-custom-fsdp"),
                         ("use_torch_fsdp2", "--use-torch-fsdp2"))]
    + [(attr, flag_, "it all-gathers quantized parameters instead of the distributed "
                     "optimizer's all-gather that LoCo compresses")
       for attr, flag_ in (("fp8_param_gather", "--fp8-param-gather"),
                           ("fp4_param_gather", "--fp4-param-gather"),
                           ("reuse_grad_buf_for_mxfp8_param_ag", "the mxfp8 parameter all-gather"))]
    + [("use_precision_aware_optimizer", "--use-precision-aware-optimizer",
        "the fused optimizer keeps the fp32 main parameters the weight differences are taken "
        "from")])


def check_param_bits_conflicts(settings, param_bits: Optional[int] = None) -> None:
    """Raise :class:`LoCoConfigError` naming ``--loco-param-bits`` (and ``param_bits``) and the
    first of :data:`PARAM_BITS_CONFLICTS` set on ``settings`` (a DDP or optimizer config, or
    Megatron-LM's arguments; missing attributes count as off)."""
    for attr, what, why in PARAM_BITS_CONFLICTS:
        if getattr(settings, attr, False):
            bits = "" if param_bits is None else f" {param_bits}"
            raise LoCoConfigError(f"{flag('param_bits')}{bits} cannot be used with {what}: {why}; "
                                  f"drop one of the two.")


def shared_settings() -> Tuple[str, ...]:
    """Fields every rank of a data-parallel group must agree on (``Setting.shared``)."""
    return tuple(name for name, s in SETTINGS.items() if s.shared)


def fingerprint(config: LoCoConfig) -> Dict[str, Any]:
    """The settings a checkpoint records with its error buffers (``Setting.checkpoint`` set)."""
    return {name: getattr(config, name) for name, s in SETTINGS.items() if s.checkpoint}


def fingerprint_fields(effect: str) -> Tuple[str, ...]:
    """Fingerprint fields whose change has ``effect`` (``"reset"``, ``"convert"``,
    ``"record"``) on resume."""
    return tuple(name for name, s in SETTINGS.items() if s.checkpoint == effect)
