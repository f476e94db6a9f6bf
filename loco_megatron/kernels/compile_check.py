"""Compile every Triton kernel variant for real GPUs, without a GPU, and check the GPU contract.

    python -m loco_megatron.kernels.compile_check [--arch sm_80 sm_90] [--subset all|ci]
                                                  [--blocks N ...] [--jobs N] [--budgets]
                                                  [--guards]

Each variant of :mod:`.variants` (compress, decompress, the weight difference's; 4/8 bits;
fp32/bf16/fp16; both grids; the block sizes listed there; arguments typed as Triton types them
at run time) is compiled by ``triton.compile`` for each architecture and its PTX assembled by
Triton's bundled ``ptxas -v`` with Triton's own flags. One line per variant gives registers and
spills; the exit status is 1 when any variant breaks a rule:

* **compiles**: Triton and ptxas succeed;
* **no spills**: ptxas reports 0 bytes of spill stores and loads (a spill is local memory
  traffic in the hot loop; the launch configuration, :mod:`.launch`, keeps tiles small enough);
* **64-bit addresses**: no integer ``+ - * / << >>`` or truncation that feeds a pointer offset
  is done in 32 bits when a runtime value reaches it. In the TTIR, for every ``tt.addptr``,
  the values its offset is computed from are walked back (through casts, broadcasts, loop
  arguments); an ``arith.addi/subi/muli/divsi/remsi/shli/shrsi/trunci/...`` whose result is
  ``i32`` (scalar or tensor) and which depends on a kernel's scalar argument, a program id or a
  loaded value is an error (``r * chunk`` of two ``i32`` arguments wraps before it is widened).
  Arithmetic on constants and ``tl.arange`` alone is bounded by constexprs and may stay 32-bit;
  an ``i32`` argument used as an offset without arithmetic is widened exactly;
* **IEEE arithmetic**: no ``fma.`` (contraction) and no approximate division in the PTX;
* **no unconditional atomics**: every ``tt.atomic_rmw`` has a mask other than the constant
  ``true`` (the NaN/Inf counter is added only by a program that met a non-finite block).

Each line also gives the variant's static performance figures (:mod:`.sass_figures`, from its
SASS): warp-instructions per element, warps per SM and the issue ceiling in elements/s against
what HBM allows. The summary lists the variants over their budget
(:data:`.sass_figures.BUDGETS`: the default block size's gradient compress and decompress);
``--budgets`` makes that a failure. ``--guards`` fails the same variants over the limits CI
enforces (:data:`.sass_figures.GUARDS`: the budget where it is met, else today's figure plus
3%, so that no change makes a kernel issue more). Variants are compiled
with the 16-byte divisibility hint Triton gives aligned pointers at launch.

The full run (default) takes minutes (``--jobs`` processes compile in parallel); ``--subset ci``
is the representative subset CI runs (:data:`.variants.CI_BLOCKS`, :data:`.variants.CI_KINDS`);
``--blocks`` checks every variant of the given block sizes only. Needs Triton (no GPU, no CUDA
driver); ``TRITON_INTERPRET`` must be unset in the process. Exit status 2: bad arguments.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, List, Optional, Tuple

from . import sass_figures
from .launch import launch_config
from .variants import Variant, all_variants, block_variants

ARITH = {"arith.addi", "arith.subi", "arith.muli", "arith.divsi", "arith.divui",
         "arith.remsi", "arith.remui", "arith.shli", "arith.shrsi", "arith.shrui",
         "arith.ceildivsi", "arith.floordivsi", "arith.trunci"}
SOURCES = ("tt.get_program_id", "tt.get_num_programs", "tt.load", "tt.atomic")
_VAL = r"%[\w.$-]+(?:#\d+)?"


def _strip_loc(line: str) -> str:
    i = line.find(" loc(")
    return line if i < 0 else line[:i]


def unconditional_atomics(ttir: str) -> List[str]:
    """The ``tt.atomic_rmw`` lines of ``ttir`` (trimmed) whose mask is the constant ``true``:
    an atomic every program issues. The compress kernel's NaN/Inf counter is masked by "a
    block of this program was non-finite", so a clean step issues no atomic at all."""
    return [_strip_loc(line).strip() for line in ttir.splitlines()
            if "tt.atomic_rmw" in line and re.search(r", %true\b[^,]*:", _strip_loc(line))]


def narrow_address_arithmetic(ttir: str) -> List[str]:
    """The 32-bit address arithmetic on runtime values in ``ttir`` (the rule of the module
    docstring): one TTIR line (trimmed) per offending operation, empty when there is none."""
    defs: Dict[str, Tuple[str, List[str], str, str]] = {}  # value -> (op, operands, type, line)
    tainted = set()
    loops: List[Optional[dict]] = []
    loop_of: Dict[str, dict] = {}
    addptr_offsets: List[str] = []
    for raw in ttir.splitlines():
        text = raw.strip()
        if text.startswith("tt.func"):
            for name, typ in re.findall(r"(%[\w.$-]+): ([^ ,)]+)", text):
                if re.fullmatch(r"i\d+", typ):
                    tainted.add(name)
            continue
        if text.startswith("}"):
            if loops:
                loops.pop()
            if text.endswith("{"):
                loops.append(None)
            continue
        if text.startswith("^bb"):  # region block arguments (reductions): runtime values
            tainted.update(re.findall(_VAL, text))
            continue
        body = _strip_loc(text)
        m = re.match(r"(?:(%[\w.$-]+)(?::(\d+))? = )?([\w.\"]+)(.*)$", body)
        if not m:
            continue
        res, nres, op, rest = m.group(1), m.group(2), m.group(3).strip('"'), m.group(4)
        typ = rest.rsplit(" : ", 1)[-1] if " : " in rest else ""
        if op == "scf.for":
            f = re.match(r"\s*(%[\w.$-]+) = (\S+) to (\S+) step (\S+)", rest)
            if f is None:
                raise ValueError(f"unexpected scf.for in the TTIR: {text[:200]}")
            info = {"iv": f.group(1), "bounds": list(f.group(2, 3, 4)), "args": [], "res": res}
            carried = rest.split("iter_args", 1)[1] if "iter_args" in rest else ""
            for a, init in re.findall(r"(%[\w.$-]+) = (" + _VAL + ")", carried):
                info["args"].append((a, init))
                loop_of[a] = info
            loop_of[info["iv"]] = info
            loops.append(info)
            continue
        if op == "scf.yield" and loops and loops[-1] is not None:
            loops[-1]["yields"] = re.findall(_VAL, rest)
        operands = re.findall(_VAL, rest.split(" : ")[0])
        if body.endswith("{"):
            loops.append(None)
        if res is None:
            continue
        names = [f"{res}#{i}" for i in range(int(nres))] if nres else [res]
        for n in names + ([res] if nres else []):
            defs[n] = (op, operands, typ, text[:160])
        if op == "tt.addptr" and len(operands) == 2:
            addptr_offsets.append(operands[1])
    for info in {id(i): i for i in loop_of.values()}.values():  # loop results come from yields
        ys = info.get("yields", [])
        for k, y in enumerate(ys):
            if info["res"]:
                defs[f"{info['res']}#{k}"] = ("scf.yield", [y], "", "")
        if info["res"] and len(ys) == 1:  # a single result is used without "#0"
            defs[info["res"]] = ("scf.yield", ys, "", "")

    def preds(v):
        if v in loop_of:
            info = loop_of[v]
            if v == info["iv"]:
                return info["bounds"]
            k = [a for a, _ in info["args"]].index(v)
            ys = info.get("yields", [])
            return [info["args"][k][1]] + ([ys[k]] if k < len(ys) else [])
        return defs[v][1] if v in defs else []

    changed = True
    while changed:  # taint flows forward; loops need a fixpoint
        changed = False
        for v in list(defs) + list(loop_of):
            if v in tainted:
                continue
            op = defs[v][0] if v in defs else ""
            if op.startswith(SOURCES) or any(p in tainted for p in preds(v)):
                tainted.add(v)
                changed = True
    bad, seen, stack = [], set(), list(addptr_offsets)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in defs:
            op, _, typ, line = defs[v]
            if op in ARITH and v in tainted and re.search(r"\bi(8|16|32)\b|xi(8|16|32)>", typ):
                bad.append(line)
            if op == "tt.load":  # a loaded value is where the walk stops
                continue
        stack.extend(preds(v))
    return sorted(set(bad))


def parse_ptxas(log: str) -> Dict[str, int]:
    """``{"registers", "spill_stores", "spill_loads", "stack"}`` from ``ptxas -v`` output.

    Raises:
        ValueError: the log has no register count (ptxas did not report on a kernel).
    """
    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        raise ValueError(f"no register count in the ptxas output: {log[-500:]!r}")
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"registers": int(regs.group(1)),
            "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0,
            "stack": int(stack.group(1)) if stack else 0}


def _ptxas(ptx: str, capability: int) -> str:
    from triton.backends.nvidia import compiler as nv

    arch = nv.sm_arch_from_capability(capability)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [nv.get_ptxas(capability).path, "-lineinfo", "--fmad=false", "-v",
               "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", src + ".o"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-1000:]}")
    return proc.stdout + proc.stderr


def compile_variant(fn, signature, constexprs, capability: int, num_warps: int = 4) -> dict:
    """Compile the ``@triton.jit`` function ``fn`` for ``sm_<capability>`` and check it, with
    the divisibility hint Triton adds at launch to every pointer argument (16-byte aligned:
    torch's allocations, and megatron's bucket views, whose starts it pads to 128 elements).

    Returns ``{"registers", "spill_stores", "spill_loads", "stack", "narrow": [TTIR lines],
    "ieee": [problems], "atomics": [unconditional atomics], "errors": [rule violations],
    "sass": the SASS, "shared": shared memory bytes}``.

    Raises:
        Exception: whatever Triton or ptxas raise on a compile failure.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a, t in signature.items() if t.startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                 attrs=attrs),
                       target=GPUTarget("cuda", capability, 32),
                       options={"enable_fp_fusion": False, "num_warps": num_warps})
    out = parse_ptxas(_ptxas(k.asm["ptx"], capability))
    out["sass"] = sass_figures.disassemble(k.asm["cubin"])
    out["shared"] = int(k.metadata.shared)
    out["narrow"] = narrow_address_arithmetic(k.asm["ttir"])
    out["atomics"] = unconditional_atomics(k.asm["ttir"])
    ptx = k.asm["ptx"]
    out["ieee"] = [w for w in ("fma.", "div.full", "div.approx") if w in ptx]
    out["errors"] = (["spills"] if out["spill_stores"] or out["spill_loads"] else []) + \
        (["32-bit address arithmetic"] if out["narrow"] else []) + \
        (["non-IEEE " + " ".join(out["ieee"])] if out["ieee"] else []) + \
        (["unconditional atomic"] if out["atomics"] else [])
    return out


def _check(job: Tuple[Variant, int]) -> Tuple[str, int, dict]:
    v, cap = job
    from . import triton_kernels as tk

    fn = tk._compress_kernel if v.kernel == "compress" else tk._decompress_kernel
    try:
        out = compile_variant(fn, v.signature, v.constexprs, cap, v.num_warps)
        out["figures"] = sass_figures.variant_figures(
            v.kernel, v.constexprs, v.signature, v.num_warps, v.block,
            launch_config(v.block).ntiles, out.pop("sass"), out["registers"], out["shared"],
            cap)
        return v.name, cap, out
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return v.name, cap, {"errors": [f"compile failed: {type(e).__name__}: "
                                        f"{str(e).strip().splitlines()[-1:]}"]}


def run(archs: List[int], subset: str, jobs: int, out=sys.stdout,
        blocks: Optional[List[int]] = None, budgets: bool = False, guards: bool = False
        ) -> int:
    """Check every variant of ``subset`` (or of the block sizes ``blocks``) for every capability
    in ``archs``; print one line per variant and a summary to ``out``. Returns the exit status
    (0: every rule holds; with ``budgets``, every :func:`.sass_figures.budget` too; with
    ``guards``, every :func:`.sass_figures.guard`)."""
    variants = [v for b in blocks for v in block_variants(b)] if blocks else all_variants(subset)
    work = [(v, cap) for cap in archs for v in variants]
    t0 = time.time()
    failed, regs, spills, over, past = 0, 0, 0, [], []
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    results = pool.map(_check, work) if pool else map(_check, work)
    try:
        for (v, _), (name, cap, r) in zip(work, results):
            limit = sass_figures.budget(v.kernel, v.name, v.constexprs)
            if limit is not None and "figures" in r and r["figures"]["per_element"] > limit:
                over.append(f"sm_{cap} {name}: {r['figures']['per_element']:.2f} > {limit}")
                if budgets:
                    r["errors"].append(f"over its budget of {limit} warp-instructions/element")
            ceiling = sass_figures.guard(v.kernel, v.name, v.constexprs)
            if ceiling is not None and "figures" in r and r["figures"]["per_element"] > ceiling:
                past.append(f"sm_{cap} {name}: {r['figures']['per_element']:.2f} > {ceiling}")
                if guards:
                    r["errors"].append(f"over its CI guard of {ceiling} warp-instructions/element")
            ok = not r["errors"]
            failed += not ok
            if "registers" in r:
                regs = max(regs, r["registers"])
                spills += r["spill_stores"]
                f = r["figures"]
                line = (f"sm_{cap} {name}: {r['registers']} registers, {r['spill_stores']} B "
                        f"spill stores, {r['spill_loads']} B spill loads, addresses "
                        f"{'64-bit' if not r['narrow'] else '32-bit!'}; "
                        f"{f['per_element']:.2f} warp-instructions/element, "
                        f"{f['warps_per_sm']} warps/SM, issue ceiling {f['ceiling']:.2e} "
                        f"elements/s ({f['ceiling'] / f['hbm_bound']:.2f}x HBM's)")
            else:
                line = f"sm_{cap} {name}"
            print(("ok   " if ok else "FAIL ") + line + ("" if ok else f"  <- {r['errors']}"),
                  file=out, flush=True)
            for n in r.get("narrow", []):
                print(f"       32-bit address arithmetic on a runtime value: {n}", file=out)
    finally:
        if pool:
            pool.shutdown()
    print(f"compile_check: {len(work)} variants ({subset if not blocks else blocks}, "
          f"{' '.join(f'sm_{c}' for c in archs)}), {failed} failed, max {regs} registers, "
          f"{spills} B spill stores, {time.time() - t0:.0f} s", file=out, flush=True)
    print(f"compile_check: {len(over)} variants over their warp-instruction budget "
          f"({'enforced' if budgets else 'reported; --budgets enforces'})"
          + "".join(f"\n  {o}" for o in over), file=out, flush=True)
    print(f"compile_check: {len(past)} variants over their CI guard "
          f"({'enforced' if guards else 'reported; --guards enforces'})"
          + "".join(f"\n  {o}" for o in past), file=out, flush=True)
    return 1 if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Command line entry point (module docstring). Returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m loco_megatron.kernels.compile_check",
                                description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"],
                   help="GPU architectures (sm_80 sm_90 by default)")
    p.add_argument("--subset", choices=("all", "ci"), default="all",
                   help="every variant (default) or the CI subset")
    p.add_argument("--blocks", type=int, nargs="+",
                   help="only these block sizes (instead of the subset's)")
    p.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8),
                   help="parallel compile processes")
    p.add_argument("--budgets", action="store_true",
                   help="fail a variant over its warp-instructions-per-element budget")
    p.add_argument("--guards", action="store_true",
                   help="fail a budgeted variant over the limit CI enforces (GUARDS)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the check compiles the kernels for GPUs")
    try:
        import triton  # noqa: F401
    except ImportError:
        p.error("Triton is not installed")
    archs = []
    for s in a.arch:
        if not re.fullmatch(r"sm_\d+a?", s):
            p.error(f"--arch {s}: expected sm_80, sm_90, ...")
        archs.append(int(s[3:].rstrip("a")))
    return run(archs, a.subset, max(1, a.jobs), blocks=a.blocks, budgets=a.budgets,
               guards=a.guards)


if __name__ == "__main__":
    sys.exit(main())
