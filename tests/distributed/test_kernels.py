"""Fused kernels (C on CPU, Triton under TRITON_INTERPRET=1) against the torch reference.

Contract (loco_megatron/kernels/__init__.py): codes, scales and error buffers bit-exact with the
reference; the reduced shard within fp32 rounding (the sums are in the same order, so in practice
equal); a non-finite block gives a non-finite scale there and keeps its previous error. The
Triton kernels are also compiled for real GPUs (sm_80, sm_90) here, without a GPU, to check that
the PTX has no FMA contraction and IEEE division (what makes the GPU results bit-exact too).
"""

import os
import subprocess
import sys

if os.environ.get("TRITON_INTERPRET") is None and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels

import pytest
import torch
import torch.distributed as dist

from loco_megatron import kernels
from loco_megatron.kernels.triton_kernels import triton_interpret as tk_interpret
from loco_megatron.collectives import compensated_reduce_scatter
from loco_megatron.compensator import Compensator, ErrorBuffer
from loco_megatron.config import GRIDS, LoCoConfig
from loco_megatron.layout import BucketLayout

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# The interpreted Triton tests run in a child pytest process that imports only this module
# (test_triton_in_clean_process): in the full suite's process other imports (megatron-core and
# what it pulls in) leave Triton's interpreter unable to call the kernels' @triton.jit helpers.
CHILD = os.environ.get("LOCO_TRITON_CHILD") == "1"
NO_TRITON = "Triton not installed (the CPU-only torch build of the compat legs)"
TRITON_MARKS = [
    pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON),
    pytest.mark.skipif(not CHILD and not torch.cuda.is_available(),
                       reason="interpreted in a clean child process: test_triton_in_clean_process")]
FUSED = ["cpu", pytest.param("triton", marks=TRITON_MARKS)]
# A bucket of 3 DP shards with parameter boundaries: blocks cut short at every cut.
LAYOUT = dict(numel=3 * 700, world=3, boundaries=(123, 1000, 1555))


def _device(impl):
    """Where ``impl`` runs here: compiled Triton on the GPU (a machine with CUDA, no
    ``TRITON_INTERPRET``), everything else on CPU. The reference always runs on CPU, where torch
    divides like the kernels (IEEE), so GPU results are compared with it bit for bit."""
    return "cuda" if impl == "triton" and not tk_interpret() else "cpu"


def _run(impl, bits, storage, dtype, block, beta, steps=4, bad=None, grid="symmetric"):
    """Per step: payload, scales, nonfinite flag, err_sq and the decoded error buffer (on CPU)."""
    dev = _device(impl)
    layout = BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], block, LAYOUT["boundaries"])
    table = kernels.block_table(layout, dev)
    err = ErrorBuffer(table.padded_numel, block, storage, torch.float32, dev, table.spans)
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        g = (torch.randn(layout.numel, generator=gen) * 10 ** (step - 2)).to(dtype)
        if bad is not None and step == 2:
            g[1234] = bad
        g = g.to(dev)
        payload, scales, nonfinite, err_sq, buf_sq = kernels.compress_bucket(
            impl, g, table, err, bits=bits, beta=beta, reset=step == 1, want_err_sq=True,
            grid=grid)
        if buf_sq is not None:  # computed on the way: the stored buffer's norm (fp32 decode)
            ref = float(err.get().double().square().sum())
            assert abs(float(buf_sq) - ref) <= 1e-6 * max(ref, 1e-30), (float(buf_sq), ref)
        out.append((payload.cpu(), scales.cpu(), bool(nonfinite), float(err_sq),
                    err.get().cpu()))
    return out


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("bits,storage,dtype", [
    (4, "int8", torch.float32), (8, "int8", torch.float32), (4, "fp32", torch.float32),
    (8, "fp32", torch.float32), (4, "int8", torch.bfloat16), (4, "int8", torch.float16),
    (8, "fp32", torch.bfloat16)])
def test_compress_bit_exact(impl, bits, storage, dtype):
    ref, got = _run("torch", bits, storage, dtype, 64, 0.8), _run(impl, bits, storage, dtype, 64, 0.8)
    for step, (r, g) in enumerate(zip(ref, got)):
        assert torch.equal(r[0], g[0]), f"step {step}: payload differs"
        assert torch.equal(r[1], g[1]), f"step {step}: scales differ"
        assert torch.equal(r[4], g[4]), f"step {step}: error buffer differs"
        assert not r[2] and not g[2]
        assert abs(r[3] - g[3]) <= 1e-5 * r[3]  # fp32 dot (reference) vs per-block sums


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("bits,storage,dtype", [
    (4, "int8", torch.float32), (8, "int8", torch.float32), (4, "fp32", torch.bfloat16),
    (8, "int8", torch.bfloat16)])
def test_compress_grid_bit_exact(impl, bits, storage, dtype):
    """--loco-grid full-range (scale absmax / 2^(b-1)): codes, scales and error buffer equal the
    reference's bit for bit, and differ from the symmetric grid's (the grid reaches the kernel:
    every scale is 7/8 (127/128) of the symmetric one, up to rounding)."""
    ref = _run("torch", bits, storage, dtype, 64, 0.8, grid="full-range")
    got = _run(impl, bits, storage, dtype, 64, 0.8, grid="full-range")
    sym = _run(impl, bits, storage, dtype, 64, 0.8)
    for step, (r, g, s) in enumerate(zip(ref, got, sym)):
        assert torch.equal(r[0], g[0]), f"step {step}: payload differs"
        assert torch.equal(r[1], g[1]), f"step {step}: scales differ"
        assert torch.equal(r[4], g[4]), f"step {step}: error buffer differs"
        assert not r[2] and not g[2]
        assert abs(r[3] - g[3]) <= 1e-5 * r[3]
        assert not torch.equal(g[0], s[0]), f"step {step}: full-range codes = symmetric codes"
        nonzero = s[1] > 0
        assert nonzero.any() and (g[1][nonzero] < s[1][nonzero]).all(), f"step {step}"
        d = 2 ** (bits - 1)
        if step == 1:  # a reset step: h = g on both grids, so the scales' absmax is the same
            torch.testing.assert_close(g[1] * d, s[1] * (d - 1), rtol=2e-7, atol=0)


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("block,beta", [(6, 0.0), (10, 0.5), (256, 0.8)])
def test_compress_odd_block_sizes_and_beta(impl, block, beta):
    """Blocks that are not powers of two (the Triton tile is masked), plain error feedback."""
    for r, g in zip(_run("torch", 4, "int8", torch.float32, block, beta),
                    _run(impl, 4, "int8", torch.float32, block, beta)):
        assert torch.equal(r[0], g[0]) and torch.equal(r[1], g[1]) and torch.equal(r[4], g[4])


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on inf/NaN
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_block(impl, bad):
    ref, got = _run("torch", 4, "int8", torch.float32, 64, 0.8, bad=bad), \
        _run(impl, 4, "int8", torch.float32, 64, 0.8, bad=bad)
    r, g = ref[2], got[2]
    assert r[2] and g[2]
    assert abs(r[3] - g[3]) <= 1e-5 * r[3]  # err_sq of the finite blocks only
    fin = torch.isfinite(r[1])
    assert torch.equal(fin, torch.isfinite(g[1])) and int((~fin).sum()) == 1
    assert torch.equal(r[1][fin], g[1][fin])
    assert torch.equal(torch.isnan(r[1]), torch.isnan(g[1]))  # NaN stays NaN, inf stays inf
    # the bad block kept the previous step's error, the others updated: as the reference
    assert torch.equal(r[4], g[4]) and torch.isfinite(g[4]).all()
    table = kernels.block_table(BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], 64,
                                                   LAYOUT["boundaries"]), "cpu")
    blk = int((~fin).nonzero())
    at, n = int(table.off[blk]), int(table.length[blk])  # the bad block's error in the buffer
    assert torch.equal(g[4][at:at + n], got[1][4][at:at + n])
    assert not torch.equal(g[4], got[1][4])
    for r, g in zip(ref[3:], got[3:]):  # and the next step is exact again
        assert torch.equal(r[0], g[0]) and torch.equal(r[4], g[4]) and not g[2]


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("bits,out_dtype,average", [
    (4, torch.float32, False), (8, torch.float32, True), (4, torch.bfloat16, True),
    (8, torch.bfloat16, False), (4, torch.float16, True)])
def test_decompress_matches_reference(impl, bits, out_dtype, average):
    dev = _device(impl)
    layout = BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], 64, LAYOUT["boundaries"])
    table = kernels.block_table(layout, "cpu")
    gen = torch.Generator().manual_seed(3)
    n = table.padded_numel
    payload = torch.randint(0, 256, (n * bits // 8,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(table.nblocks, generator=gen) * 1e-2
    for rank in range(table.world):
        ref = torch.full((table.shard,), 7.0, dtype=out_dtype)
        got = ref.clone().to(dev)
        kernels.decompress_shard("torch", payload, scales, table, rank, bits=bits,
                                 average=average, out=ref)
        kernels.decompress_shard(impl, payload.to(dev), scales.to(dev),
                                 kernels.block_table(layout, dev), rank, bits=bits,
                                 average=average, out=got)
        got = got.cpu()
        tol = dict(rtol=1e-6, atol=1e-9) if out_dtype == torch.float32 else dict(rtol=0, atol=0)
        torch.testing.assert_close(got, ref, **tol)


def _triton_only(fn):
    for mark in TRITON_MARKS:
        fn = mark(fn)
    return fn


@_triton_only
@pytest.mark.parametrize("bits,storage,beta", [(4, "int8", 0.8), (8, "fp32", 0.0)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computing on NaN
def test_triton_launch_configs_bit_identical(bits, storage, beta):
    """Blocks of 96 (48 pairs: a partly masked tile) under the default launch configuration
    (one tile of 64 pairs, 16 blocks per program) and a tiled one (6 tiles of 8 pairs, 2 blocks
    per program: the multi-pass path large blocks take): codes, scales, error buffers and the
    decompressed shards equal each other's and the reference's bit for bit (a NaN step too)."""
    from loco_megatron.kernels import triton_kernels as tk
    from loco_megatron.kernels.launch import custom_config, launch_config

    dev, block = _device("triton"), 96
    layout = BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], block, LAYOUT["boundaries"])
    configs = [launch_config(block), custom_config(block, rows=2, tile=8)]
    assert configs[0].ntiles == 1 and configs[1].ntiles == 6
    outs = []
    for impl, launch in [("torch", None)] + [("triton", c) for c in configs]:
        d = dev if impl == "triton" else "cpu"
        table = kernels.block_table(layout, d)
        err = ErrorBuffer(table.padded_numel, block, storage, torch.float32, d, table.spans)
        gen = torch.Generator().manual_seed(5)
        got = []
        for step in range(3):
            g = torch.randn(layout.numel, generator=gen) * 10 ** (step - 1)
            g[700 + step] = float("nan") if step == 2 else g[700 + step]
            kw = dict(bits=bits, beta=beta, reset=step == 1, want_err_sq=True)
            if impl == "torch":
                p, s, nf, sq, _ = kernels.compress_bucket("torch", g, table, err, **kw)
            else:
                p, s, nf, sq, _ = tk.compress_bucket(g.to(d), table, err, launch=launch, **kw)
            shard = torch.empty(table.shard)
            if impl == "torch":
                kernels.decompress_shard("torch", p, s, table, 1, bits=bits, average=True,
                                         out=shard)
            else:
                shard = shard.to(d)
                tk.decompress_shard(p, s, table, 1, bits=bits, average=True, out=shard,
                                    launch=launch)
            got.append((p.cpu(), s.cpu(), int(nf), float(sq), err.get().cpu(), shard.cpu()))
        outs.append(got)
    for step, (r, a, b) in enumerate(zip(*outs)):
        fin = torch.isfinite(r[1])
        assert r[2] == a[2] == b[2] == (step == 2), step
        for x in (a, b):
            assert torch.equal(x[1][fin], r[1][fin]) and torch.equal(x[4], r[4]), step
            assert abs(x[3] - r[3]) <= 1e-5 * r[3], step
            if step < 2:  # (the codes of a NaN block are not defined)
                assert torch.equal(x[0], r[0]), step
                assert torch.equal(x[5], r[5]), step
        assert torch.equal(a[0], b[0]) and _same_bits(a[1], b[1]), step  # config vs config
        assert torch.equal(a[5].isnan(), b[5].isnan()), step
        assert torch.equal(a[5].nan_to_num(), b[5].nan_to_num()), step


@_triton_only
def test_triton_decompress_world_one_average():
    """A one-rank group with AVG (a direct compensated_reduce_scatter on a 1-rank group): the
    kernel divides by world == 1, which a launch passes as a constexpr int (the compile check
    compiles that variant); the shard equals the reference's."""
    dev = _device("triton")
    layout = BucketLayout.build(300, 1, 64, (77,))
    table = kernels.block_table(layout, "cpu")
    gen = torch.Generator().manual_seed(4)
    payload = torch.randint(0, 256, (table.padded_numel * 4 // 8,), dtype=torch.uint8,
                            generator=gen)
    scales = torch.rand(table.nblocks, generator=gen)
    ref = torch.empty(table.shard)
    got = torch.empty(table.shard, device=dev)
    kernels.decompress_shard("torch", payload, scales, table, 0, bits=4, average=True, out=ref)
    kernels.decompress_shard("triton", payload.to(dev), scales.to(dev),
                             kernels.block_table(layout, dev), 0, bits=4, average=True, out=got)
    assert torch.equal(got.cpu(), ref)


def test_select():
    cpu = torch.zeros(4)
    assert kernels.select("torch", cpu) == "torch"
    assert kernels.select("auto", cpu) == "cpu"
    from loco_megatron.emulation import cpu_cuda

    cpu_cuda.activate()  # CPU tensors that report is_cuda: still the C kernel
    try:
        assert torch.zeros(4, device="cuda").is_cuda
        assert kernels.select("auto", torch.zeros(4, device="cuda")) == "cpu"
    finally:
        cpu_cuda.deactivate()
    assert kernels.select("auto", cpu.double()) == "torch"  # exact fp64 identities
    with pytest.raises(ValueError, match="--loco-kernels 'fast'"):
        kernels.select("fast", cpu)
    with pytest.raises(ValueError, match="--loco-kernels cpu: the C kernels run on CPU"):
        kernels.select("cpu", torch.zeros(4, device="meta"))


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.select("triton", torch.zeros(4))


def _reduce_worker(rank, world, impls):
    layout = BucketLayout.build(world * 500, world, 32, (77, 640))
    outs = {}
    for impl in impls:
        comp = Compensator(LoCoConfig(bits=4, block_size=32, kernels=impl))
        outs[impl] = []
        for step in range(3):
            g = torch.randn(world * 500, generator=torch.Generator().manual_seed(step * 10 + rank))
            out = torch.empty(500)
            compensated_reduce_scatter(out, g, op=dist.ReduceOp.AVG, compensator=comp, key=0,
                                       layout=layout)
            outs[impl].append(out)
    return outs


def test_reduce_scatter_same_result_as_reference(run_ranks):
    """3 gloo ranks, parameter cuts, AVG: every implementation reduces to the reference's
    shards (the C kernel always; Triton where installed and interpreted, in the clean child
    process: gloo ranks hold CPU tensors, which compiled Triton cannot read)."""
    impls = ["torch", "cpu"] + (["triton"] if HAVE_TRITON and CHILD and tk_interpret()
                                else [])
    for outs in run_ranks(_reduce_worker, 3, impls):
        for impl in impls[1:]:
            for a, b in zip(outs["torch"], outs[impl]):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)


def _variants_worker(rank, world, telemetry):
    """Steps of a flat and a hierarchical bucket with Triton (reset every 2nd step): the Triton
    launch keys of each step (loco_megatron/kernels/launch_keys.py)."""
    from loco_megatron.collectives import WireStats
    from loco_megatron.hierarchical import hierarchical_reduce_scatter
    from loco_megatron.kernels import launch_keys
    from loco_megatron.metrics import StepMetrics

    layouts = [BucketLayout.build(world * 300, world, 32, (77, 640)),
               BucketLayout.build(world * 200, world, 32, (13,))]
    comp = Compensator(LoCoConfig(bits=4, block_size=32, kernels="triton", reset_interval=2,
                                hierarchical=True, intra_node_bits=8))
    if telemetry:
        comp.metrics = StepMetrics(WireStats())
    steps = []
    for step in range(4):
        with launch_keys.recording() as keys:
            for key, (layout, reduce) in enumerate(zip(layouts, (
                    compensated_reduce_scatter, hierarchical_reduce_scatter))):
                g = torch.randn(layout.numel, generator=torch.Generator().manual_seed(step + rank))
                out = torch.empty(layout.shard)
                reduce(out, g, op=dist.ReduceOp.AVG, compensator=comp, key=key, layout=layout,
                       async_op=True).wait()
        steps.append(sorted(set(keys)))
    return steps, comp.stats.resets


@pytest.mark.parametrize("telemetry", [False, True])
@pytest.mark.skipif(not HAVE_TRITON or not CHILD, reason="interpreted Triton runs in the clean "
                    "child process (test_triton_in_clean_process)")
def test_triton_variants_all_launched_in_the_first_step(run_ranks, telemetry):
    """Each kernel variant of a run is compiled in its first step and no later: through a
    reset step (``RESET`` is a runtime flag, not a constexpr), with telemetry on or off, on the
    flat and the hierarchical (8-bit intra-node, 4-bit inter-node) paths, 4 ranks on 2 emulated
    nodes. Every later step's Triton launch keys are among the first step's."""
    for steps, resets in run_ranks(_variants_worker, 4, telemetry, local_world_size=2):
        assert resets >= 2, resets  # step 2 of each bucket (the hierarchical one: both stages)
        first = set(steps[0])
        assert len(first) >= 4, first  # compress and decompress of 2 stages and the flat path
        for i, later in enumerate(steps[1:], 1):
            assert set(later) <= first, (i, sorted(set(later) - first))


COMPILE_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loco_megatron.kernels import triton_kernels as tk
from loco_megatron.kernels.variants import block_variants
target = GPUTarget("cuda", int(sys.argv[1]), 32)
# the default block size, arguments typed as a launch types them (sizes i32, world == 1 a
# constexpr): loco_megatron/kernels/variants.py, what the compile check builds
variants = block_variants(256)
for v in (variants[0], variants[8], variants[11]):  # compress; decompress AVG, world i32 / 1
    fn = tk._compress_kernel if v.kernel == "compress" else tk._decompress_kernel
    k = triton.compile(ASTSource(fn=fn, signature=v.signature, constexprs=v.constexprs),
                       target=target, options={"enable_fp_fusion": False,
                                               "num_warps": v.num_warps})
    sys.stdout.write(v.name + "\n" + k.asm["ptx"] + "\n=====KERNEL=====\n")
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton not installed")
@pytest.mark.parametrize("arch", [80, 90])
def test_triton_kernels_compile_for_gpus_without_fma(arch):
    """PTX for sm_80/sm_90 (compiled here without a GPU): no FMA contraction, IEEE division;
    the decompress kernel also with world == 1 (a constexpr) and AVG. Every variant and block
    size: python -m loco_megatron.kernels.compile_check (tests/unit/test_compile_check.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(arch)], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        if "ptxas" in proc.stderr or "CUDA" in proc.stderr:
            pytest.skip(f"cannot compile for sm_{arch} here: {proc.stderr.strip()[-300:]}")
        raise AssertionError(proc.stderr[-3000:])
    ptxs = proc.stdout.split("=====KERNEL=====")[:-1]
    assert len(ptxs) == 3, proc.stdout[-2000:]
    for ptx in ptxs:
        assert ".entry" in ptx
        assert "fma." not in ptx  # no contraction: the same roundings as the reference
        assert "div.full" not in ptx and "div.approx" not in ptx
    comp, decomp, decomp1 = ptxs
    assert comp.lstrip().startswith("compress grad b4 bf16")
    assert "world=i32" in decomp.lstrip().splitlines()[0]
    assert "world=1" in decomp1.lstrip().splitlines()[0]
    assert "div.rn.f32" in comp and "atom" in comp
    assert "div.rn.f32" in decomp  # AVG (by world == 1 it may fold away)


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.skipif(CHILD or torch.cuda.is_available(), reason="this is the child / a GPU runs them")
def test_triton_in_clean_process():
    """Every ``triton`` case above (and the 3-rank reduce-scatter with Triton) under
    ``TRITON_INTERPRET=1`` in a fresh pytest process; fails with the child's output."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, LOCO_TRITON_CHILD="1", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
         "-k", "(triton and not compile and not clean_process and not needs_interpreter) "
         "or reduce_scatter_same", "-W", "ignore::RuntimeWarning"],
        env=env, cwd=root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


def test_reference_divides_by_tensors_not_python_numbers():
    """On CUDA, torch computes ``tensor / python_number`` as a multiplication by the fp32
    reciprocal (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), not IEEE division: about half
    of all 4-bit scales ``amax / 7`` would then differ by one ulp from the C and Triton kernels,
    and the torch reference on a GPU would not be the bit-exact reference it claims to be. Every
    division of the reference (compress, int8 error storage, AVG decompress) must take a tensor
    divisor; checked on CPU by recording the aten calls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar_divs = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_) \
                    and not isinstance(args[1], torch.Tensor):
                scalar_divs.append((str(func), args[1]))
            return func(*args, **(kwargs or {}))

    layout = BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], 64, LAYOUT["boundaries"])
    table = kernels.block_table(layout, "cpu")
    err = ErrorBuffer(table.padded_numel, 64, "int8", torch.float32, "cpu", table.spans)
    g = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    with Record():
        payload, scales, *_ = kernels.compress_bucket("torch", g, table, err, bits=4, beta=0.8,
                                                      reset=False, want_err_sq=True)
        kernels.decompress_shard("torch", payload, scales, table, 0, bits=4,
                                 average=True, out=torch.empty(table.shard))
    assert not scalar_divs, scalar_divs


def _random_case(seed):
    """A random bucket: block 2..256 (not only powers of two), DP 1-4, parameter cuts, buckets
    smaller than one block, and gradients from one of several awkward value families; some
    with a NaN/inf (often next to a block's padding)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=gen))]  # noqa: E731
    block, world = pick([2, 4, 6, 10, 64, 96, 256]), pick([1, 2, 3, 4])
    numel = world * int(torch.randint(1, 2 * block + 3, (1,), generator=gen))
    cuts = sorted({int(c) for c in torch.randint(1, numel, (3,), generator=gen)} - {0}) \
        if numel > 1 else []
    layout = BucketLayout.build(numel, world, block, tuple(cuts))
    kind = pick(["normal", "denormal", "tiny", "huge", "negzero", "zero", "ties", "fp16max"])
    dtype = pick([torch.float32, torch.bfloat16, torch.float16])
    if kind == "fp16max":
        dtype = torch.float16
    return dict(layout=layout, bits=pick([4, 8]), storage=pick(["int8", "fp32"]), dtype=dtype,
                beta=pick([0.0, 0.5, 0.8, 0.999]), kind=kind, seed=seed,
                bad=(int(torch.randint(numel, (1,), generator=gen)),
                     pick([float("nan"), float("inf"), -float("inf")])) if seed % 4 == 3 else None,
                grid=pick(GRIDS))  # drawn last: the other draws of a seed are unchanged


def _values(kind, n, gen):
    x = torch.randn(n, generator=gen)
    return {"normal": x * 10.0 ** float(torch.randint(-6, 6, (1,), generator=gen)),
            "denormal": x * 1e-40, "huge": x * 1e37, "zero": torch.zeros(n),
            "tiny": torch.randint(-3, 4, (n,), generator=gen).float() * 1.4e-45,
            "negzero": torch.where(torch.arange(n) % 3 == 0, x * 1e-3, -torch.zeros(n)),
            "ties": torch.randint(-16, 17, (n,), generator=gen).float() * 0.5,
            "fp16max": (torch.rand(n, generator=gen) * 2 - 1) * 65504}[kind]


def _run_case(impl, case, steps=4):
    dev = _device(impl)
    layout = case["layout"]
    table = kernels.block_table(layout, dev)
    err = ErrorBuffer(table.padded_numel, layout.block_size, case["storage"], torch.float32, dev,
                      table.spans)
    gen = torch.Generator().manual_seed(case["seed"])
    out = []
    for step in range(steps):
        g = _values(case["kind"], layout.numel, gen).to(case["dtype"])
        if case["bad"] is not None and step == 1:
            g[case["bad"][0]] = case["bad"][1]
        p, s, nf, _, _ = kernels.compress_bucket(impl, g.to(dev), table, err, bits=case["bits"],
                                                 beta=case["beta"], reset=step == 2,
                                                 want_err_sq=True, grid=case["grid"])
        out.append((p.cpu(), s.cpu(), bool(nf), {k: v.cpu().clone() for k, v in
                                                  err.tensors().items()}, err.get().cpu()))
    return out


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 \
        else torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("impl,seeds", [("cpu", range(150)), pytest.param(
    "triton", range(24), marks=TRITON_MARKS)])
def test_compress_randomized_differential(impl, seeds, monkeypatch):
    """Codes, scales (bit patterns: -0.0, denormals) and the stored error buffer equal the
    reference's over random layouts and value families, both grids (--loco-grid), reset steps
    and beta 0; in a non-finite step the bad block's kept error too, but not the payload: the codes of a NaN block are not
    defined (the reference converts NaN to int8). Triton under the interpreter skips bf16 denormals: the interpreter's
    bf16 -> fp32 conversion flushes them (a GPU's ``cvt.f32.bf16`` is exact). A payload the
    kernels allocate without zero-fill (``BlockTable.dense``) starts as 0xA5 bytes here: a byte
    the kernel does not write shows."""
    real = kernels.BlockTable.payload_alloc

    def poisoned(self, bits):
        alloc = real(self, bits)
        return alloc if alloc is torch.zeros else (
            lambda *a, **k: torch.empty(*a, **k).fill_(0xA5))
    monkeypatch.setattr(kernels.BlockTable, "payload_alloc", poisoned)
    for seed in seeds:
        case = _random_case(seed)
        if impl == "triton" and tk_interpret() and case["dtype"] == torch.bfloat16 \
                and case["kind"] in ("denormal", "tiny"):
            continue
        for step, (r, g) in enumerate(zip(_run_case("torch", case), _run_case(impl, case))):
            where = f"seed {seed} step {step}: {case}"
            assert r[2] == g[2], where
            nan = torch.isnan(r[1]) & torch.isnan(g[1])
            assert _same_bits(r[1][~nan], g[1][~nan]), where
            for name in r[3]:  # a non-finite block kept its error: the same bits too
                assert _same_bits(r[3][name], g[3][name]), (name, where)
            assert torch.isfinite(g[4]).all(), where
            if r[2]:  # the codes of a NaN block are not defined (the reference casts NaN)
                continue
            assert torch.equal(r[0], g[0]), where


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (4, torch.bfloat16),
                                        (8, torch.float32), (8, torch.bfloat16)])
def test_weight_difference_bit_exact(impl, bits, dtype):
    """--loco-param-bits: encode (Q(new - held)) and apply (held + deQ) of every shard give the
    reference's codes, scales and held parameters bit for bit."""
    from loco_megatron import weight_difference as wd

    dev = _device(impl)
    layout = BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], 64, LAYOUT["boundaries"])
    gen = torch.Generator().manual_seed(11)
    held = (torch.randn(layout.numel, generator=gen) * 0.02).to(dtype)
    new = held.float() + torch.randn(layout.numel, generator=gen) * 1e-3
    for rank in range(layout.world):
        part = slice(rank * layout.shard, (rank + 1) * layout.shard)
        ref = wd.encode("torch", new[part], held[part], layout, rank, bits)
        got = wd.encode(impl, new[part].to(dev), held[part].to(dev), layout, rank, bits)
        assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])
        ref_held, got_held = held[part].clone(), held[part].clone().to(dev)
        wd.apply("torch", ref_held, *ref, layout, rank, bits)
        wd.apply(impl, got_held, got[0], got[1], layout, rank, bits)
        assert torch.equal(got_held.cpu(), ref_held)
        assert not torch.equal(ref_held, held[part])  # it moved


@pytest.mark.parametrize("impl", FUSED)
@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.float16),
                                        (4, torch.float32)])
def test_bucket_apply_equals_the_shard_by_shard_apply(impl, bits, dtype):
    """The fused apply of a whole bucket (every rank's gathered chunk, one
    kernels.apply_chunks over the bucket's flat table) gives the reference's shard-by-shard
    apply bit for bit, on every shard."""
    from loco_megatron import weight_difference as wd

    dev = _device(impl)
    layout = BucketLayout.build(LAYOUT["numel"], LAYOUT["world"], 64, LAYOUT["boundaries"])
    gen = torch.Generator().manual_seed(5)
    held = (torch.randn(layout.numel, generator=gen) * 0.02).to(dtype)
    new = held.float() + torch.randn(layout.numel, generator=gen) * 1e-3
    chunks = [wd.encode("torch", new[r * layout.shard:(r + 1) * layout.shard],
                        held[r * layout.shard:(r + 1) * layout.shard], layout, r, bits)
              for r in range(layout.world)]
    ref = held.clone()
    for r, (p, s) in enumerate(chunks):
        wd.apply("torch", ref[r * layout.shard:(r + 1) * layout.shard], p, s, layout, r, bits)
    got = held.clone().to(dev)
    table = kernels.block_table(layout, dev if impl != "torch" else "cpu")
    kernels.apply_chunks(impl, torch.cat([p for p, _ in chunks]).to(dev),
                         torch.cat([s for _, s in chunks]).to(dev), table, bits=bits, out=got)
    assert torch.equal(got.cpu(), ref) and not torch.equal(ref, held)
