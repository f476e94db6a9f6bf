"""Launch configuration of the Triton kernels, chosen by block size (no Triton import).

A program of either kernel works on a ``[rows, tile]`` tile of even elements and one of odd
elements (the two nibbles of a packed byte): ``rows`` blocks side by side, ``tile`` element
pairs of each. A block of ``B`` elements has ``B / 2`` pairs; up to :data:`MAX_TILE` pairs
(``B <= 1024``) it is one tile (``tile = next_pow2(B / 2)``) and the kernels make one pass; a
larger block is cut into ``ntiles = ceil(B / 2 / MAX_TILE)`` tiles of :data:`MAX_TILE` pairs: the
compress kernel loops over them (absmax first, then quantize: the scale needs the whole block;
``ntiles`` is a runtime loop count, so every such block size compiles to the same code) and
the decompress kernel runs one program per tile.

A program is one warp (two for tiles of :data:`WIDE_TILE` pairs, four for blocks of several
tiles) over :data:`WARP_PAIRS` pairs and more: a block's reductions (absmax, NaN, error norms) then stay inside a warp, with no
shared-memory round trip between warps, and each thread holds at least 4 pairs, enough to
amortize the per-row and per-rank work. The configuration is chosen by the static figures of
``python -m loco_megatron.kernels.compile_check`` (warp-instructions per element,
docs/kernels.md): at the default block 256 it halves the compress kernel's instructions per
element against the 4-warp ``[8, 128]`` tiles it replaced (5.23 to 2.55 on sm_90) and cuts the
decompress's by 30% (0.71 to 0.50). ``rows * tile`` is at most :data:`TILE_PAIRS`, so the
registers a program needs do not grow with the block size: no register spills at any block
size ``--loco-block-size`` accepts, on sm_80 and sm_90 (checked by the compile check). Every
block is computed on its own, so outputs do not depend on the configuration (bit for bit;
only the per-block telemetry sums of squares may round differently).
"""

from dataclasses import dataclass

#: most element pairs of a block in one tile; larger blocks loop over tiles
MAX_TILE = 512
#: element pairs per warp a program tile reaches when blocks are small (``rows * tile``):
#: ``[128, 1]`` at block 2, ``[1, 128]`` at the default block 256; 4 per thread
WARP_PAIRS = 128
#: most element pairs of a program tile (``rows * tile``)
TILE_PAIRS = MAX_TILE
#: most blocks per program (tiny blocks: a ``[128, 1]`` tile for blocks of 2)
MAX_ROWS = 128
#: warps per program; WIDE_WARPS from tiles of WIDE_TILE pairs; TILED_WARPS for blocks of
#: several tiles (with 2 warps, ptxas spills 4 B around the division's slow-path call in the
#: one-block-bucket variant of power-of-two blocks from 2048 on)
NUM_WARPS = 1
WIDE_WARPS = 2
WIDE_TILE = 512
TILED_WARPS = 4


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class LaunchConfig:
    """How the kernels cut a bucket of ``block_size`` blocks into programs.

    Attributes:
        rows: blocks per program (a power of two).
        tile: element pairs per block per tile (a power of two, ``<= MAX_TILE``).
        ntiles: tiles per block, ``ceil(block_size / 2 / tile)``.
        num_warps: warps per program.
    """

    rows: int
    tile: int
    ntiles: int
    num_warps: int = NUM_WARPS


def launch_config(block_size: int) -> LaunchConfig:
    """The configuration for blocks of ``block_size`` elements (even, ``>= 2``).

    Raises:
        ValueError: ``block_size`` odd or below 2.
    """
    if block_size < 2 or block_size % 2:
        raise ValueError(f"block size {block_size} must be an even integer >= 2")
    pairs = block_size // 2
    tile = min(next_pow2(pairs), MAX_TILE)
    rows = max(1, min(MAX_ROWS, WARP_PAIRS // tile))
    ntiles = -(-pairs // tile)
    warps = TILED_WARPS if ntiles > 1 else WIDE_WARPS if tile >= WIDE_TILE else NUM_WARPS
    return LaunchConfig(rows=rows, tile=tile, ntiles=ntiles, num_warps=warps)


def custom_config(block_size: int, rows: int, tile: int, num_warps: int = NUM_WARPS
                  ) -> LaunchConfig:
    """Another configuration for ``block_size`` (tests: any configuration gives the same
    output). ``rows`` and ``tile`` must be powers of two.

    Raises:
        ValueError: ``rows`` or ``tile`` not a power of two.
    """
    for name, v in (("rows", rows), ("tile", tile)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} {v} is not a power of two")
    tile = min(tile, next_pow2(block_size // 2))
    return LaunchConfig(rows=rows, tile=tile, ntiles=-(-(block_size // 2) // tile),
                        num_warps=num_warps)
