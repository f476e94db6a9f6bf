"""Static performance figures of a compiled Triton kernel, from its SASS, without a GPU.

For the compile check (:mod:`.compile_check`): the cubin Triton builds for ``sm_80``/``sm_90``
is disassembled by Triton's bundled ``nvdisasm`` and its instructions are counted along the
path a warp runs in a clean step:

* the kernel's own function only: the IEEE division's slow path
  (``__cuda_sm3x_div_rn_noftz_f32_slowpath``, taken for denormal or huge quotients) is a
  subroutine, and the few instructions that set up its call (at most :data:`COLD_MAX`, no
  branch among them), which a predicated forward branch skips on the fast path, are cold too;
* every other instruction once per warp (predicated-off instructions still issue), except a
  loop's body (a backward branch), which runs ``trips`` times: the compress kernel's tile
  loops (``ntiles``, multi-tile blocks) and the decompress kernel's loop over the ranks
  (``world``).

``per element = (straight + body * trips) * warps / elements per program``, in
warp-instructions: what the SM's schedulers issue (4 per SM per clock on sm_80 and sm_90, one
warp-instruction each). The issue ceiling is ``SMs * 4 * clock / per element`` elements/s, and
the occupancy (warps per SM) comes from the registers, warps and shared memory of a program
(NVIDIA CUDA C++ Programming Guide, "Compute Capabilities", tables 21-22; A100 and H100 SXM
data sheets for SMs and boost clocks). A kernel is memory-bound when its ceiling exceeds the
elements/s HBM bandwidth allows.
"""

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Arch:
    """One GPU per capability: SMs, boost clock (Hz), HBM bandwidth (bytes/s), registers and
    shared memory per SM (bytes), most warps and programs per SM."""

    gpu: str
    sms: int
    clock_hz: float
    hbm_bytes_s: float
    registers: int = 65536
    shared: int = 0
    max_warps: int = 64
    max_programs: int = 32


#: the GPUs the figures are for: A100 SXM 80 GB (sm_80) and H100 SXM (sm_90)
ARCHS: Dict[int, Arch] = {
    80: Arch("A100 SXM", sms=108, clock_hz=1.41e9, hbm_bytes_s=2.039e12, shared=167936),
    90: Arch("H100 SXM", sms=132, clock_hz=1.98e9, hbm_bytes_s=3.35e12, shared=233472),
}
#: H200's HBM3e bandwidth (an sm_90 part like H100 SXM, same SMs and clock), bytes/s
H200_HBM_BYTES_S = 4.8e12
#: warp-instructions an SM issues per clock (4 schedulers)
ISSUE_PER_CLOCK = 4
#: registers are allocated per warp in units of 256; each program reserves 1 KiB of shared
REG_UNIT, SHARED_RESERVED = 256, 1024

#: most instructions of a slow path's call set-up (moves, the call) a branch skips
COLD_MAX = 16
_INST = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?);")
_LABEL = re.compile(r"^(\S+):\s*$")
_TARGET = re.compile(r"`\((\S+?)\)")


def disassemble(cubin: bytes) -> str:
    """The SASS of ``cubin`` (``nvdisasm -c``, Triton's bundled copy).

    Raises:
        RuntimeError: nvdisasm failed.
    """
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr[-500:]}")
    return proc.stdout


def _functions(sass: str) -> Tuple[Dict[str, List[tuple]], Dict[str, int]]:
    """``({function: [(address, predicate, opcode, operands)]}, {label: address})``."""
    funcs: Dict[str, List[tuple]] = {}
    labels: Dict[str, int] = {}
    current, pending = None, []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m and not line[0].isspace():
            name = m.group(1)
            if not name.startswith((".L", ".text.")):
                current = name
            pending.append(name)
            continue
        m = _INST.match(line)
        if m and current is not None:
            addr = int(m.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            funcs.setdefault(current, []).append(
                (addr, (m.group(2) or "").strip(), m.group(3), m.group(4)))
    return funcs, labels


def hot_path(sass: str, kernel: str) -> Tuple[int, int]:
    """``(straight, body)``: warp-instructions of ``kernel``'s function a warp issues once,
    and those inside its loops (per trip), on the clean path (module doc).

    Raises:
        ValueError: ``kernel`` is not in ``sass``, or its loops nest.
    """
    funcs, labels = _functions(sass)
    if kernel not in funcs:
        raise ValueError(f"no function {kernel!r} in the SASS (found {sorted(funcs)})")
    code = funcs[kernel]
    cold, loops = set(), []
    for addr, pred, op, rest in code:
        if not op.startswith("BRA"):
            continue
        m = _TARGET.search(rest)
        target = labels.get(m.group(1)) if m else None
        if target is None:
            continue
        if target > addr:
            skipped = [c for c in code if addr < c[0] < target]
            if (pred and len(skipped) <= COLD_MAX and any(c[2].startswith("CALL") for c in skipped)
                    and not any(c[2].startswith("BRA") for c in skipped)):
                cold.update(c[0] for c in skipped)  # a slow path's call set-up
        elif target < addr:
            loops.append((target, addr))
        else:  # nvdisasm's ``BRA`` to itself after the last ``EXIT``: never issued
            cold.add(addr)
    for i, (a0, a1) in enumerate(loops):
        for b0, b1 in loops[i + 1:]:
            if a0 <= b0 <= a1 or b0 <= a0 <= b1:
                raise ValueError(f"{kernel}: nested loops at {a0:#x}-{a1:#x}, {b0:#x}-{b1:#x}")
    straight = body = 0
    for addr, _, op, _ in code:
        if addr in cold or op == "NOP":
            continue
        if any(a0 <= addr <= a1 for a0, a1 in loops):
            body += 1
        else:
            straight += 1
    return straight, body


def per_element(straight: int, body: int, trips: int, num_warps: int, elements: int) -> float:
    """Warp-instructions per element (module doc) of a program of ``num_warps`` warps that
    runs its loops ``trips`` times over ``elements`` elements in all."""
    return (straight + body * trips) * num_warps / elements


def warps_per_sm(registers: int, num_warps: int, shared: int, arch: Arch) -> int:
    """Resident warps per SM for programs of ``num_warps`` warps using ``registers`` per
    thread and ``shared`` bytes of shared memory."""
    per_warp = -(-registers * 32 // REG_UNIT) * REG_UNIT
    by_regs = arch.registers // (per_warp * num_warps) if per_warp else arch.max_programs
    by_shared = arch.shared // (shared + SHARED_RESERVED)
    programs = min(by_regs, by_shared, arch.max_programs, arch.max_warps // num_warps)
    return programs * num_warps


def issue_ceiling(instructions_per_element: float, arch: Arch) -> float:
    """Elements/s the SMs can issue at ``instructions_per_element``."""
    return arch.sms * ISSUE_PER_CLOCK * arch.clock_hz / instructions_per_element


#: warp-instruction budgets per element: the default gradient compress (4 bits, int8
#: error, the default block size) and the gradient decompress per received code, at which
#: they are memory-bound on H100 and H200 (``--budgets`` enforces them)
BUDGETS = {"compress": 1.2, "decompress": 0.6}
#: what CI enforces (``--guards``) on the same variants: the budget where the kernel meets it,
#: else the figure reached today plus 3% (a regression fails CI; docs/kernels.md says why the
#: compress kernel is not at its budget yet)
GUARDS = {"compress": 1.65, "decompress": 0.6}
#: ``--loco-block-size``'s default (loco_megatron.config.LoCoConfig): the budgeted variants'
DEFAULT_BLOCK = 256


def _budgeted(kernel: str, name: str, constexprs: Dict) -> bool:
    """Is a compile-check variant (``kernel``, its ``name`` and constexprs, :mod:`.variants`)
    a budgeted one: the default block size's gradient compress at 4 bits with int8 error, or
    its gradient decompress over several ranks."""
    if constexprs.get("B") != DEFAULT_BLOCK or " grad " not in name:
        return False
    if kernel == "compress":
        return constexprs["BITS"] == 4 and bool(constexprs["INT8_ERR"])
    return kernel == "decompress" and "world" not in constexprs


def budget(kernel: str, name: str, constexprs: Dict) -> Optional[float]:
    """The :data:`BUDGETS` entry of a budgeted variant (:func:`_budgeted`); None for the
    others."""
    return BUDGETS[kernel] if _budgeted(kernel, name, constexprs) else None


def guard(kernel: str, name: str, constexprs: Dict) -> Optional[float]:
    """The :data:`GUARDS` entry (CI's limit) of a budgeted variant; None for the others."""
    return GUARDS[kernel] if _budgeted(kernel, name, constexprs) else None


#: the ranks a decompress figure is for (its loop over the ranks runs ``world`` times)
FIGURE_WORLD = 8
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "i16": 2}


def hbm_bytes_per_element(kernel: str, constexprs: Dict, signature: Dict) -> float:
    """Bytes of HBM traffic per element (gradient element for compress, received code for
    decompress at :data:`FIGURE_WORLD` ranks) that the kernel cannot avoid: compress reads the
    gradient and the stored error and writes the new error and the codes (int8 error: 1 B
    each way, fp32: 4 B); decompress reads the codes and writes the output once per
    ``world`` codes (the weight-difference apply, ``ACCUMULATE``, also reads it). Scales and
    block tables (per block) are left out."""
    bits = constexprs["BITS"] / 8
    if kernel == "compress":
        grad = _DTYPE_BYTES[signature["g_ptr"].lstrip("*")]
        err = 2 if constexprs["INT8_ERR"] else 8
        return grad + err + bits
    world = constexprs.get("world", FIGURE_WORLD)
    out = _DTYPE_BYTES[signature["out_ptr"].lstrip("*")] * (2 if constexprs.get("ACCUMULATE")
                                                            else 1)
    return bits + out / world


def variant_figures(kernel: str, constexprs: Dict, signature: Dict, num_warps: int,
                    block: int, ntiles: int, sass: str, registers: int, shared: int,
                    capability: int) -> Dict[str, float]:
    """The figures of one compiled variant (module doc): ``per_element``
    (warp-instructions), ``warps_per_sm``, ``ceiling`` (elements/s the SMs issue),
    ``hbm_bound`` (elements/s the HBM bandwidth allows, :func:`hbm_bytes_per_element`) and
    ``memory_bound`` (1.0 when ``ceiling >= hbm_bound``). ``kernel``: ``"compress"`` (a program
    is ``ROWS`` blocks of ``block`` elements, its tile loops run ``ntiles`` times) or
    ``"decompress"`` (a program is one tile of ``ROWS`` blocks from each of
    :data:`FIGURE_WORLD` ranks, or one rank when ``world`` is a constexpr).

    Raises:
        ValueError: see :func:`hot_path`; an unknown capability.
    """
    if capability not in ARCHS:
        raise ValueError(f"no figures for sm_{capability} (known: {sorted(ARCHS)})")
    arch = ARCHS[capability]
    straight, body = hot_path(sass, f"_{kernel}_kernel")
    rows, tile = constexprs["ROWS"], constexprs["T"]
    if kernel == "compress":
        trips = 1 if constexprs["ONE_TILE"] else ntiles
        elements = rows * block
    else:
        trips = constexprs.get("world", FIGURE_WORLD)
        elements = rows * min(block, 2 * tile) * trips
    ipe = per_element(straight, body, trips, num_warps, elements)
    ceiling = issue_ceiling(ipe, arch)
    hbm = arch.hbm_bytes_s / hbm_bytes_per_element(kernel, constexprs, signature)
    return {"per_element": ipe, "warps_per_sm": warps_per_sm(registers, num_warps, shared, arch),
            "ceiling": ceiling, "hbm_bound": hbm, "memory_bound": float(ceiling >= hbm)}
