"""The Triton kernel variants the compile check builds (:mod:`.compile_check`), typed as
Triton types them at run time.

A launch passes Python ints below ``2^31`` as ``i32``, an int equal to 1 as a constexpr (so
``world == 1``, one block per shard, one block per bucket compile differently), and ints from
``2^31`` as ``i64``; floats are always ``fp32``. A variant is a kernel, its argument types and
its constexprs (block size and launch configuration from :func:`.launch.launch_config`, bits,
grid divisor, error storage, step kind, output dtype).

Block sizes (``--loco-block-size``: even, 2..65536). The kernels depend on the block size ``B``
only through the launch configuration (:func:`.launch.launch_config`: ``rows``, ``tile``,
warps, one tile or several) and the bound ``B / 2`` of the tile masks (a constant in a
comparison). A block of at most 1024 elements is one tile, ``tile = next_pow2(B / 2)``: one
class per power of two. A larger block is several tiles of 512 pairs whose count is a runtime
argument of the compress kernel (a loop count, never specialized) and a grid dimension of the
decompress kernel: one class, whatever the block size. :data:`FULL_BLOCKS` holds every power of
two 2..65536 (each class, the extremes) and the non-powers 6, 96, 1026, 4094 and 65534
(partially masked tiles in one- and multi-tile blocks, a last tile of one pair), so every
accepted block size shares its class and code with a checked one
(``tests/unit/test_compile_check.py`` checks that for every even size). :data:`CI_BLOCKS` is the
representative subset: the extremes, the default, and a multi-tile block whose last tile is
partly masked; of each, the kinds :data:`CI_KINDS`.
"""

from dataclasses import dataclass, field
from typing import Dict, List

from ..quantization import divisor
from .launch import launch_config

FULL_BLOCKS = tuple(2 ** k for k in range(1, 17)) + (6, 96, 1026, 4094, 65534)
CI_BLOCKS = (2, 256, 4094, 65536)
#: the variants (indices into :func:`block_variants`) the CI subset compiles per block size:
#: each kernel (compress, decompress, the weight difference's), 4 and 8 bits, each dtype, both
#: grids and error storages, sizes i32 and i64, world == 1
CI_KINDS = (0, 2, 4, 7, 8, 10, 11, 12)

FLOATS = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class Variant:
    """One kernel compile: ``kernel`` (``"compress"``/``"decompress"``), a readable ``name``,
    its runtime ``signature`` (argument -> Triton type), ``constexprs`` and ``num_warps``."""

    kernel: str
    name: str
    block: int
    signature: Dict[str, str] = field(default_factory=dict)
    constexprs: Dict[str, object] = field(default_factory=dict)
    num_warps: int = 4


def _compress(block, bits, dtype, grid, storage, beta, errsq, nblocks="i32",
              tag="grad"):
    cfg = launch_config(block)
    int8 = storage == "int8"
    sig = {"g_ptr": "*" + FLOATS[dtype], "src_ptr": "*i64", "off_ptr": "*i64",
           "len_ptr": "*i32", "nblocks": nblocks,
           "ecodes_ptr": "*i8" if int8 else "*fp32", "escales_ptr": "*fp32",
           "evalues_ptr": "*fp32", "payload_ptr": "*u8" if bits == 4 else "*i8",
           "scales_ptr": "*fp32", "flag_ptr": "*i32",
           "errsq_ptr": "*fp32" if errsq else "*i32", "bufsq_ptr": "*fp32" if errsq else "*i32",
           "beta": "fp32", "omb": "fp32", "smax": "fp32", "ntiles": "i32", "reset": "i32"}
    consts = {"B": block, "T": cfg.tile, "ONE_TILE": cfg.ntiles == 1, "ROWS": cfg.rows,
              "BITS": bits,
              "DIV": divisor(bits, grid), "INT8_ERR": int8,
              "USE_BETA": beta, "ERRSQ": errsq}
    if nblocks == "constexpr":
        consts["nblocks"] = 1
    name = (f"compress {tag} b{bits} {dtype} {grid} err={storage}"
            f"{'' if beta else ' beta=0'}"
            f"{' errsq' if errsq else ''} nblocks={nblocks if nblocks != 'constexpr' else 1}")
    return _variant("compress", name, block, sig, consts, cfg.num_warps)


def _decompress(block, bits, out, average, sizes="i32", world="i32", tag="grad",
                accumulate=False):
    cfg = launch_config(block)
    sig = {"payload_ptr": "*u8" if bits == 4 else "*i8", "scales_ptr": "*fp32",
           "out_ptr": "*i16" if out == "bf16" else "*" + FLOATS[out], "src_ptr": "*i64",
           "off_ptr": "*i64", "len_ptr": "*i32", "nbs": sizes, "first": sizes,
           "out_base": sizes, "chunk": sizes, "off_base": sizes, "world": world}
    consts = {"B": block, "T": cfg.tile, "ROWS": cfg.rows, "BITS": bits, "AVERAGE": average,
              "OUT_BF16": out == "bf16", "ACCUMULATE": accumulate}
    if world == "constexpr":
        consts["world"] = 1
    name = (f"decompress {tag} b{bits} out={out} {'avg' if average else 'sum'} sizes={sizes} "
            f"world={1 if world == 'constexpr' else world}{' accumulate' if accumulate else ''}")
    return _variant("decompress", name, block, sig, consts, cfg.num_warps)


def _variant(kernel, name, block, sig, consts, num_warps):
    sig = dict(sig)
    sig.update({k: "constexpr" for k in consts})
    return Variant(kernel, f"{name} B={block}", block, sig, consts, num_warps)


def block_variants(block: int) -> List[Variant]:
    """Every variant compiled for ``block``: the gradient path (4/8 bits, fp32/bf16/fp16
    gradients, both grids, int8/fp32 error storage, telemetry on/off (a reset step is
    a runtime flag: the same code); a
    one-block bucket, ``nblocks`` a constexpr), its decompression (fp32/bf16/fp16 outputs,
    SUM/AVG, sizes ``i32`` and ``i64``, ``world == 1`` a constexpr with AVG), and the weight
    difference's (fp32 error storage, reset, beta 0; applied by the decompress kernel with
    ``world == 1`` accumulating into bf16 and fp32 parameters)."""
    return [
        _compress(block, 4, "bf16", "symmetric", "int8", True, True),
        _compress(block, 8, "fp32", "full-range", "int8", True, True),
        _compress(block, 4, "fp16", "full-range", "fp32", True, True),
        _compress(block, 8, "bf16", "symmetric", "fp32", True, False),
        _compress(block, 4, "fp32", "symmetric", "int8", True, True, nblocks="i64"),
        _compress(block, 4, "bf16", "symmetric", "int8", False, False,
                  nblocks="constexpr"),
        _compress(block, 4, "fp32", "symmetric", "fp32", False, False, tag="weightdiff"),
        _compress(block, 8, "fp32", "symmetric", "fp32", False, False, tag="weightdiff"),
        _decompress(block, 4, "bf16", True),
        _decompress(block, 8, "fp32", False),
        _decompress(block, 4, "fp16", True, sizes="i64", world="i64"),
        _decompress(block, 8, "bf16", True, world="constexpr"),
        _decompress(block, 4, "bf16", False, world="constexpr", tag="weightdiff",
                    accumulate=True),
        _decompress(block, 8, "fp32", False, world="constexpr", tag="weightdiff",
                    accumulate=True),
    ]


def all_variants(subset: str) -> List[Variant]:
    """``"all"``: :func:`block_variants` of every :data:`FULL_BLOCKS` size; ``"ci"``: the
    :data:`CI_KINDS` of the :data:`CI_BLOCKS` sizes (every kernel, each dtype, both grids).

    Raises:
        ValueError: an unknown subset.
    """
    if subset not in ("all", "ci"):
        raise ValueError(f"subset {subset!r} is not 'all' or 'ci'")
    if subset == "all":
        return [v for b in FULL_BLOCKS for v in block_variants(b)]
    return [block_variants(b)[k] for b in CI_BLOCKS for k in CI_KINDS]
