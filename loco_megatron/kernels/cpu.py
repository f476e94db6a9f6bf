"""CPU fused kernels (``--loco-kernels cpu``): ``cpu_kernels.c`` compiled on first use, via ctypes.

The C file is built once per source version and CPU model with the system C compiler (``$CC``,
default ``cc``) into ``$LOCO_KERNEL_CACHE`` (default ``~/.cache/loco_megatron/kernels``), written
under a temporary name and renamed, so ranks building at the same time never load a half-written
file.
No torch headers are involved (the build takes well under a second). ``$CC`` may carry arguments
(``CC="ccache gcc"``). Without a working compiler, without ``cpu_kernels.c`` (an install
that lacks the package's data files), or when the cached library does not load (a truncated
file, a ``noexec`` cache directory), ``auto`` falls back to the torch reference
(:mod:`loco_megatron.algorithm`) and says so once in the log; a failed build leaves no
temporary file.

ctypes releases the GIL during the call, so the compressed all-to-alls of other buckets keep
running. fp32 and bf16 gradients are read directly; fp16 ones are converted to fp32 first (one
extra pass).
"""

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from ..algorithm import accumulate
from ..quantization import divisor, max_scale

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
#: IEEE fp32 semantics: no fast-math, no FMA contraction (the torch reference does none).
#: -march=native: built on the machine that runs it (the cache key includes the CPU's flags).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
          "-fPIC", "-shared")
_P = ctypes.c_void_p


def _cache_dir() -> Path:
    root = os.environ.get("LOCO_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "loco_megatron" / "kernels"


def _cpu_flags() -> str:
    """This CPU's feature flags (a -march=native build must not run on another CPU model)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


@lru_cache(maxsize=1)
def _load():
    """(library, None) or (None, reason)."""
    try:
        src = SOURCE.read_bytes()
    except OSError as exc:  # an install without its package data (a wheel built without it)
        return None, (f"the C kernel source {SOURCE} cannot be read "
                      f"({exc.strerror or exc}): this loco-megatron install lacks its package "
                      f"data; reinstall it (pip install . from the repository, or its wheel)")
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256(src + " ".join((cc,) + CFLAGS + (_cpu_flags(),)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"loco_cpu_kernels_{tag}.so"
    if not target.exists():
        tmp = None
        try:
            cc_argv = shlex.split(cc)  # CC="ccache gcc" or "gcc -std=c11", as make allows
            if not cc_argv:
                raise OSError("$CC is empty")
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            proc = subprocess.run([*cc_argv, *CFLAGS, "-o", tmp, str(SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode:
                return None, f"{cc} failed to build {SOURCE.name}: {proc.stderr.strip()[:500]}"
            os.replace(tmp, target)
            tmp = None
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            return None, f"cannot build {SOURCE.name} with {cc!r} into {target.parent}: {exc}"
        finally:
            if tmp is not None:  # a failed build leaves no half-written file behind
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:  # a truncated or foreign file in the cache, a noexec cache dir
        return None, (f"cannot load {target} ({exc}); delete it to rebuild, or set "
                      f"LOCO_KERNEL_CACHE to another directory")
    lib.loco_compress.restype = ctypes.c_int64
    lib.loco_compress.argtypes = [_P, ctypes.c_int, _P, _P, _P, ctypes.c_int64, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _P, ctypes.c_float,
                                  ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                  ctypes.c_float, _P, _P]
    lib.loco_decompress.restype = ctypes.c_int
    lib.loco_decompress.argtypes = [_P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int, _P]
    return lib, None


def unavailable_reason(tensor: torch.Tensor) -> Optional[str]:
    """None when the C kernels can process ``tensor``, else why not."""
    if tensor.device.type != "cpu":
        return f"the C kernels run on CPU tensors, this one is on {tensor.device}"
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {tensor.dtype} is not supported (fp32, bf16, fp16)"
    lib, reason = _load()
    if lib is None:
        if not getattr(unavailable_reason, "_logged", False):
            logger.warning("LoCo: using the torch reference on CPU: %s", reason)
            unavailable_reason._logged = True
        return reason
    return None


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else _P(t.data_ptr())


def compress_bucket(g, table, err, *, bits, beta, reset, want_err_sq, grid="symmetric"):
    """C implementation of :func:`loco_megatron.kernels.compress_bucket`."""
    lib, _ = _load()
    g = g.reshape(-1).contiguous()
    if g.dtype not in (torch.float32, torch.bfloat16):
        g = g.float()
    # zeros only where some wire elements no block covers (alignment, a shorter shard's end):
    # they are zero codes; the kernel writes every other byte
    payload = table.payload_alloc(bits)(table.padded_numel * bits // 8, dtype=torch.uint8)
    scales = torch.empty(table.nblocks, dtype=torch.float32)
    err_sq = torch.zeros((), dtype=torch.float64) if want_err_sq else None
    buf_sq = torch.zeros((), dtype=torch.float64) if want_err_sq else None
    int8 = err.storage == "int8"
    if not int8 and err.values.dtype != torch.float32:
        raise ValueError(f"the C kernels keep fp32 error values, got {err.values.dtype}")
    rc = lib.loco_compress(_ptr(g), int(g.dtype == torch.bfloat16), _ptr(table.src),
                           _ptr(table.off), _ptr(table.length), table.nblocks, table.block_size, bits, int(int8),
                           _ptr(err.codes if int8 else None), _ptr(err.scales if int8 else None),
                           _ptr(None if int8 else err.values), _ptr(payload), _ptr(scales),
                           float(beta), 1.0 - float(beta), int(beta != 0), int(reset),
                           max_scale(bits, grid), float(divisor(bits, grid)), _ptr(err_sq),
                           _ptr(buf_sq))
    if rc < 0:
        raise MemoryError("loco_compress: out of memory for a block workspace")
    if not int8:  # fp32 storage: not computed in C (it wrote -1)
        buf_sq = None
    # no host reads or tensors built from host data: this path stands in for the device
    # kernels in the CPU checks of the GPU contract (loco_megatron/emulation/host_sync.py)
    return payload, scales, torch.full((), rc, dtype=torch.int32), err_sq, buf_sq


def decompress_shard(payload, scales, table, rank, *, bits, average, out):
    """C implementation of :func:`loco_megatron.kernels.decompress_shard`."""
    lib, _ = _load()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    target = out if direct else torch.empty(out.numel(), dtype=torch.float32)
    nbs = table.blocks_per_shard
    P = table.padded_shard
    rc = lib.loco_decompress(_ptr(payload), _ptr(scales), _ptr(table.src), _ptr(table.off),
                             _ptr(table.length), nbs, rank * nbs, rank * table.shard, P,
                             rank * P, table.world, table.block_size, bits, int(average), 0,
                             0, _ptr(target))
    if rc < 0:
        raise MemoryError("loco_decompress: out of memory for a block workspace")
    if not direct:
        out.copy_(target.view_as(out))


def apply_chunks(payload, scales, table, *, bits, out):
    """C implementation of :func:`loco_megatron.kernels.apply_chunks`: one call of the C
    decompress over every block of ``table`` (``world == 1``), accumulating into fp32 or bf16
    ``out`` in place (fp16: into an fp32 difference, added by
    :func:`loco_megatron.algorithm.accumulate`).

    Raises:
        ValueError: ``out`` not contiguous.
    """
    if not out.is_contiguous():
        raise ValueError("apply_chunks writes a contiguous output (a bucket's param_data)")
    lib, _ = _load()
    fused = out.dtype in (torch.float32, torch.bfloat16)
    target = out if fused else torch.empty(out.numel(), dtype=torch.float32)
    rc = lib.loco_decompress(_ptr(payload), _ptr(scales), _ptr(table.src), _ptr(table.off),
                             _ptr(table.length), table.nblocks, 0, 0, 0, 0, 1,
                             table.block_size, bits, 0, int(fused),
                             int(out.dtype == torch.bfloat16), _ptr(target))
    if rc < 0:
        raise MemoryError("loco_decompress: out of memory for a block workspace")
    if not fused:  # every element is in one block: target is the whole difference
        accumulate(out.view(-1), target)
