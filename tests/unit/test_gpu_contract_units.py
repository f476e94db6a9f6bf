"""Pieces of the GPU contract (docs/kernels.md), each checked on the CPU: no host sync from
LoCo's timers, the NaN/Inf counter read on the stream that wrote it, block tables and shard
layouts that stay cached for every bucket of a step, the weight difference's discarded error
without a buffer per call, ``--loco-kernels auto`` refusing to fall back on a GPU, and full-
iteration CUDA graphs refused in one line. The whole step is checked by
tests/distributed/test_gpu_contract.py."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from loco_megatron import caches, kernels, weight_difference
from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.emulation.host_sync import HostSyncCounter
from loco_megatron.layout import BucketLayout

pytestmark = pytest.mark.unit


def test_counter_sees_what_would_sync_and_skips_host_tensors():
    """The counter itself: device reads and synchronizes count, host tensors do not."""
    x = torch.randn(8)
    host = caches.host_tensor(torch.arange(4))
    with HostSyncCounter() as c:
        x.sum().item()
        bool(x[0] > 0)
        x[x > 0]
        torch.cuda.synchronize()
        int(host.sum())  # a CPU table: no device sync
        built = torch.tensor([1, 2, 3])  # host data: built on the host
        built.sum().tolist()
    ops = [(e.category, e.op) for e in c.events]
    assert ops == [("sync", "item"), ("sync", "bool"), ("sync", "boolean-mask indexing"),
                   ("sync", "cuda.synchronize"), ("host_build", "tensor")], ops
    assert all(e.owner == "other" for e in c.events)


def test_counter_sees_every_device_to_host_sync():
    """Each source of a device-to-host sync the counter knows (host_sync's module doc), one
    call each, in order; a non-blocking copy into a host tensor (the NaN/Inf monitor's) and
    host-only work are not syncs."""
    x = torch.randn(8)
    n = torch.tensor(3).add(0)  # computed on the device: a device scalar
    with HostSyncCounter() as c:
        host = torch.zeros(8, device="cpu")  # asked for the host: a host tensor
        x.to("cpu")
        host.copy_(x)
        host.copy_(x, non_blocking=True)  # into pinned memory behind an event: no sync
        torch.equal(x, x)
        torch.allclose(x, x)
        torch.is_nonzero(x[:1].sum())
        repr(x)
        f"{x.sum():.3f}"
        torch.where(x > 0)
        torch.where(x > 0, x, 0.0)  # three arguments: a device op
        x.long().abs().bincount()
        torch.unique_consecutive(x)
        x[:n]
        x[1:3]  # Python bounds: no sync
        host.sum().item()  # a host tensor
    ops = [op for cat, op in ((e.category, e.op) for e in c.events) if cat == "sync"]
    assert ops == ["to(cpu)", "copy_ to the host", "equal", "allclose", "is_nonzero", "format",
                   "format", "where(condition)", "bincount", "unique_consecutive",
                   "slicing by a tensor"], ops


def test_counter_enters_megatron_backward_hooks(monkeypatch):
    """torch runs autograd hooks without the function-mode stack: a sync in a megatron-core
    method called from a gradient hook (as ``register_grad_ready`` is with overlap on) is
    seen because the counter re-enters itself in the methods of ``HOOK_ENTRIES``; a sync in
    any other hook is not (that is why the list exists), and the wrap is gone after exit."""
    import sys
    import types

    from loco_megatron.emulation import hook_modes

    class BucketGroup:
        def register_grad_ready(self, param):
            param.grad.sum().item()  # (returns None, as a gradient hook must)

    module = types.ModuleType("fake_param_and_grad_buffer")
    module.BucketGroup = BucketGroup
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(hook_modes, "HOOK_ENTRIES",
                        ((module.__name__, "BucketGroup", ("register_grad_ready",)),))
    plain = BucketGroup.register_grad_ready
    group, p = BucketGroup(), torch.nn.Parameter(torch.randn(4))
    # looked up at call time, as megatron's hook does (self.param_to_bucket_group[param]...)
    p.register_post_accumulate_grad_hook(lambda q: group.register_grad_ready(q))
    p.register_post_accumulate_grad_hook(lambda q: [q.grad.sum().tolist()] and None)  # not one
    with HostSyncCounter() as c:
        (p * 2).sum().backward()
        group.register_grad_ready(p)  # a direct call: counted once, not twice
    assert [e.op for e in c.events] == ["item", "item"], c.summary()
    assert BucketGroup.register_grad_ready is plain


def test_loco_timers_never_synchronize():
    """``--timing-log-level 2``: megatron's Timer synchronizes at every start and stop; LoCo's
    timers (three per bucket) record events instead, registered in megatron's ``Timers`` where
    its ``log`` reads them (a positive time, reset on read)."""
    from megatron.core.timers import Timers

    from loco_megatron.collectives import TIMER_NAMES, step_timer

    timers = Timers(2, "minmax")
    with HostSyncCounter() as c:
        for _ in range(50):  # 50 buckets
            for name in TIMER_NAMES:
                t = step_timer(timers, name)
                t.start()
                torch.randn(1000).sum()
                t.stop()
    assert c.count(category="sync") == 0, c.summary()
    # what Timers.log reads per name (megatron/core/timers.py _get_elapsed_time_all_ranks)
    elapsed = [timers._timers[n].elapsed(reset=True) for n in TIMER_NAMES]
    assert all(e > 0.0 for e in elapsed), elapsed
    assert all(timers._timers[n].elapsed() == 0.0 for n in TIMER_NAMES)  # reset
    assert step_timer(Timers(1, "minmax"), TIMER_NAMES[0]).__class__.__name__ == "_NoTimer"


def test_nonfinite_counter_is_read_on_the_stream_that_wrote_it(monkeypatch):
    """With several distributed-optimizer instances and overlap, the compress kernels (and the
    NaN/Inf count) run on megatron's communication stream: the monitor's copy of the count and
    its event are issued on that stream, not on the current one."""
    from loco_megatron import nonfinite

    current = ["main"]
    issued = []

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = before

    class Event:
        def record(self, stream=None):
            issued.append(("event", stream or current[0]))

        def query(self):
            return False

    class Host:
        def copy_(self, src, non_blocking=False):
            issued.append(("copy", current[0]))

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(nonfinite, "_on_device", lambda t: True)
    monkeypatch.setattr(nonfinite, "_pinned_scalar", Host)
    comp = SimpleNamespace(nonfinite_count=torch.zeros((), dtype=torch.int64),
                           nonfinite_stream="communication", stats=None)
    nonfinite.NonfiniteMonitor(comp).poll()
    assert issued == [("copy", "communication"), ("event", "communication")], issued


def test_block_tables_and_shard_layouts_stay_cached_for_every_bucket():
    """Tables of 600 buckets at DP 2 and of 40 buckets at DP 16 (more than the old 512-entry
    LRU held), each with the parameter path's per-rank shard layouts (buckets x DP): a second
    pass over them builds nothing and copies nothing."""
    caches.clear()
    layouts = [BucketLayout.build(2 * (130 + i), 2, 64, (37,)) for i in range(600)] + [
        BucketLayout.build(16 * (200 + i), 16, 64, (37, 1000 + i)) for i in range(40)]

    def one_step():
        for lay in layouts:
            kernels.block_table(lay, "cpu")
            for shard in weight_difference.shard_layouts(lay):
                kernels.block_table(shard, "cpu")

    one_step()
    with HostSyncCounter() as c:
        one_step()
    assert c.count() == 0, c.summary()
    assert caches.sizes()["loco_megatron.kernels.block_table._cached"] > 512  # some coincide
    caches.clear()
    assert caches.sizes()["loco_megatron.kernels.block_table._cached"] == 0


def test_weight_difference_encode_allocates_no_error_buffer():
    """The discarded error of a weight difference: no new buffer, spans copy or host read per
    call once warm (was a fresh fp32 ErrorBuffer, ``spans.to(device)`` and ``int(spans.sum())``
    per bucket per step); codes and scales unchanged."""
    from torch.overrides import TorchFunctionMode

    lay = BucketLayout.build(2 * 3000, 2, 64, (700, 2500))
    diff = torch.randn(lay.shard, generator=torch.Generator().manual_seed(0))
    first = weight_difference.encode_difference("cpu", diff, lay, 1, 4)
    buffers = []

    class Allocations(TorchFunctionMode):  # fp32 tensors of a shard's size or more
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.zeros, torch.empty, torch.full) and out.dtype == torch.float32 \
                    and out.numel() >= lay.shard:
                buffers.append(out.numel())
            return out

    with HostSyncCounter() as c, Allocations():
        again = weight_difference.encode_difference("cpu", diff, lay, 1, 4)
    assert c.count(owner="loco") == 0, c.summary()
    assert buffers == [], buffers
    ref = weight_difference.encode_difference("torch", diff, lay, 1, 4)
    for a, b, r in zip(first, again, ref):
        assert torch.equal(a, b) and torch.equal(a, r)


def test_auto_kernels_refuse_a_gpu_without_triton(monkeypatch):
    """``--loco-kernels auto`` on a CUDA tensor without Triton: one line naming the flag (it
    used to run the torch reference silently, copying tables to the device on every call)."""
    from loco_megatron.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "triton", None)
    on_gpu = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"--loco-kernels auto: Triton is not installed.*"
                                         r"--loco-kernels torch"):
        kernels.select("auto", on_gpu)
    assert kernels.select("torch", on_gpu) == "torch"


@pytest.mark.parametrize("flags,named", [
    (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl full_iteration"),
    (["--cuda-graph-scope", "full_iteration"], "--cuda-graph-scope full_iteration")])
def test_full_iteration_cuda_graph_refused_in_one_line(flags, named, monkeypatch):
    """Refused at preflight (and by the ranks, tests/unit/test_preflight_table.py) with a line
    naming the flag; per-layer graphs and LoCo off pass."""
    from loco_megatron.cli.preflight import preparse_loco_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--use-distributed-optimizer"]
    with pytest.raises(LoCoConfigError) as err:
        preparse_loco_config([*base, "--loco-bits", "4", *flags])
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{named} cannot be used with --loco-bits 4")
    preparse_loco_config([*base, "--loco-bits", "16", *flags])
    preparse_loco_config([*base, "--loco-bits", "4", "--cuda-graph-impl", "local",
                          "--cuda-graph-modules", "attn", "mlp"])
    assert isinstance(preparse_loco_config([*base]), LoCoConfig)


def test_megatron_coalesces_without_a_device():
    """LoCo issues its all-to-alls, and waits on them, inside megatron-core's
    ``_coalescing_manager`` blocks (param_and_grad_buffer.py). That is legal on NCCL only
    because megatron calls it without ``device=``: then every collective in the block runs
    eagerly, not batched until the block ends. An upgrade that passes a device would make
    LoCo's waits inside the block hang: this reads every call in the installed megatron-core."""
    import ast
    import inspect

    from megatron.core.distributed import param_and_grad_buffer

    tree = ast.parse(inspect.getsource(param_and_grad_buffer))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", getattr(n.func, "attr", None)) == "_coalescing_manager"]
    assert calls, "megatron-core no longer calls _coalescing_manager: re-check LoCo's seam"
    for call in calls:
        assert "device" not in {k.arg for k in call.keywords} and len(call.args) < 2, \
            f"param_and_grad_buffer.py:{call.lineno} passes a device to _coalescing_manager"


def test_collectives_refuse_graph_capture_and_a_foreign_device(monkeypatch):
    """The runtime guards of every LoCo collective (``collectives.check_launch``, called by the
    flat and hierarchical reduce-scatters and the parameter all-gather), one line each: a CUDA
    graph being captured, a gradient on another device than the current one; CPU tensors (and
    the emulation's) pass."""
    from loco_megatron import collectives

    on = SimpleNamespace(device=torch.device("cuda", 1))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    collectives.check_launch(on, "the LoCo reduce-scatter")
    collectives.check_launch(torch.zeros(2), "the LoCo reduce-scatter")
    capturing[0] = True
    with pytest.raises(RuntimeError, match=r"^LoCo: the LoCo reduce-scatter was called while a "
                                           r"CUDA graph is being captured.*--loco-bits 16\.$"):
        collectives.check_launch(on, "the LoCo reduce-scatter")
    capturing[0] = False
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match=r"got a tensor on cuda:1 while the current device "
                                           r"is cuda:0; call torch.cuda.set_device"):
        collectives.check_launch(on, "the LoCo parameter all-gather")


def test_bucket_group_launch_guarded_before_earlier_buckets_are_queried(monkeypatch):
    """megatron's ``start_grad_sync`` under LoCo refuses a CUDA graph capture before it queries
    or finishes earlier buckets' handles (``InFlight.finish_landed``: an event query and a
    decompress would be captured). Planted: a handle whose query fails the test."""
    import loco_megatron
    from loco_megatron import collectives
    from loco_megatron.megatron import plugin

    class Queried(collectives.LoCoWork):
        def landed(self):
            raise AssertionError("an earlier bucket was queried during the capture")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    group = SimpleNamespace(
        ddp_config=SimpleNamespace(use_distributed_optimizer=True),
        intra_distributed_optimizer_instance_size=2,
        buckets=[SimpleNamespace(grad_data=SimpleNamespace(device=torch.device("cuda", 0)))])
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4))
    try:
        state.in_flight.add([Queried([object()], lambda: None)])
        start = plugin._wrap_start_grad_sync(lambda self, *a, **k: None)
        with pytest.raises(RuntimeError, match=r"^LoCo: the LoCo reduce-scatter was called "
                                               r"while a CUDA graph is being captured"):
            start(group)
    finally:
        loco_megatron.uninstall()


def test_hierarchical_reorder_index_cleared_with_the_model():
    """The hierarchical stage-1 reorder indices (one per layout and device) go with the
    model's caches, as ``uninstall()`` clears them."""
    from loco_megatron import hierarchical

    out = hierarchical._reorder(torch.arange(6.0), 3, (2, 0, 1))
    assert out.tolist() == [4.0, 5.0, 0.0, 1.0, 2.0, 3.0] and hierarchical._ORDER_INDEX
    caches.clear()
    assert hierarchical._ORDER_INDEX == {}


def test_allocation_tracker_follows_loco_storages():
    """LoCo's new storages are recorded with their bytes and forgotten once nobody else holds
    them (a view keeps its storage alive); views, in-place results and allocations outside
    ``loco_megatron`` are not LoCo's memory. Planted: code compiled under a LoCo file name."""
    import os

    import loco_megatron.compensator as owner
    from loco_megatron.emulation.alloc_tracker import AllocationTracker

    code = ("def send(n):\n    a = torch.zeros(n, dtype=torch.uint8)\n"
            "    return a, torch.empty(n // 4, dtype=torch.float32), a[: n // 2]\n")
    ns = {"torch": torch}
    exec(compile(code, owner.__file__, "exec"), ns)
    with AllocationTracker() as t:
        other = torch.zeros(1000)  # this test's own: not LoCo's
        a, b, view = ns["send"](4096)
        a.add_(1)  # in place: no new memory
        assert t.sweep() == 4096 + 4096 and t.peak_bytes == 8192
        del a, b
        assert t.sweep() == 4096  # the view holds the payload's storage
        del view
        assert t.sweep() == 0 and t.peak_bytes == 8192
        where = {w.split(":")[0] for w, _ in t.peak_live}
        assert where == {os.path.join("loco_megatron", "compensator.py")}, t.peak_live
    del other


def test_allocation_tracker_settles_after_a_late_release():
    """A storage a worker thread lets go of a moment after the step (gloo's worker thread drops a
    finished work after ``wait()`` returned) is counted by a lone sweep and not by
    ``settle`` (here: quiet for 0.5 s). Planted: a thread that holds the send buffer 0.05 s
    more."""
    import threading
    import time

    import loco_megatron.compensator as owner
    from loco_megatron.emulation.alloc_tracker import AllocationTracker

    ns = {"torch": torch}
    exec(compile("def send(n):\n    return torch.zeros(n, dtype=torch.uint8)\n",
                 owner.__file__, "exec"), ns)
    with AllocationTracker() as t:
        held = [ns["send"](4096)]
        worker = threading.Thread(target=lambda: (time.sleep(0.05), held.clear()))
        worker.start()
        assert t.sweep() == 4096  # still held by the "worker"
        assert t.settle(quiet=5, interval_s=0.1) == 0
        worker.join()


def test_step_memory_counts_bucket_groups():
    """With overlap, a bucket group launches all its buckets before LoCo can finish one: the
    low end (each group landed by the next launch) is the largest group's buffers; groups that
    do not split the buckets are refused. Without overlap, one bucket's buffers, whatever the
    groups. The bound holds whatever order megatron's hooks launch the buckets in."""
    from loco_megatron.config import LoCoConfig
    from loco_megatron.layout import BucketLayout
    from loco_megatron.step_memory import step_memory

    cfg = LoCoConfig(bits=4)
    buckets = [(BucketLayout.build(n, 2, 64), 4) for n in (1024, 2048, 512)]
    wire = [2 * lay.world * lay.wire_bytes_per_peer(4) for lay, _ in buckets]
    each = step_memory(cfg, buckets, overlap=True, in_flight=1)
    grouped = step_memory(cfg, buckets, overlap=True, in_flight=1, groups=[2, 1])
    off = step_memory(cfg, buckets, overlap=False, groups=[2, 1])
    assert each.transient == max(wire) and off.transient == max(wire)
    assert grouped.transient == wire[0] + wire[1]
    assert step_memory(cfg, buckets, overlap=True, groups=[3]).transient == sum(wire)
    with pytest.raises(ValueError, match=r"groups \[2, 2\] do not split the 3 buckets"):
        step_memory(cfg, buckets, overlap=True, groups=[2, 2])
    # the bound does not depend on the order the hooks launch in (an fp16 bucket's fp32 copy on
    # CPU ranks, first or last); fp16 flags per bucket
    first, last = (step_memory(cfg, order, overlap=True, device="cpu", fp16=f).transient
                   for order, f in ((buckets, [True, False, False]),
                                    (buckets[1:] + buckets[:1], [False, False, True])))
    assert first == last == sum(wire) + 4 + 4 * 1024 - wire[0] // 2  # wire: both ways
    with pytest.raises(ValueError, match="fp16 has 2 entries for 3 buckets"):
        step_memory(cfg, buckets, overlap=True, fp16=[True, False])


def test_payload_zero_filled_only_where_blocks_leave_gaps():
    """No zero-fill of a payload the kernels overwrite: a bucket whose blocks tile
    the wire is allocated with ``torch.empty`` at 4 and 8 bits; an odd-length block (its last
    byte's high nibble is written as a zero code) only at 4; a shard padded to the longest one
    keeps the zero-fill."""
    from loco_megatron.kernels.block_table import block_table
    from loco_megatron.layout import BucketLayout

    dense = block_table(BucketLayout.build(1024, 2, 256), "cpu")
    assert dense.dense == {4, 8} and dense.payload_alloc(8) is torch.empty
    odd = block_table(BucketLayout.build(600, 2, 256, (3, 303)), "cpu")  # 3 + 297, 3 + 297
    assert odd.dense == {4} and odd.payload_alloc(8) is torch.zeros
    padded = block_table(BucketLayout.build(600, 2, 256, (3,)), "cpu")  # 3 + 297 | 300
    assert padded.dense == frozenset() and padded.payload_alloc(4) is torch.zeros


def test_lane_and_padded_copies_launch_a_fixed_number_of_ops():
    """The ``--loco-full-precision-1d`` lane and the wire-layout copies of the hierarchical
    16-bit stage (``BucketLayout.to_lane``/``from_lane_shard``, ``to_padded``/
    ``from_padded_shard``) run the same number of torch ops for 4 and for 40 parameters
    (launches per bucket independent of the parameter count). Planted: the former
    slice-per-segment loop in the scatter (33 ops for 4 parameters, 177 for 40)."""
    from torch.overrides import TorchFunctionMode

    from loco_megatron import caches
    from loco_megatron.layout import BucketLayout

    class Ops(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(params):
        numel = 2 * 64 * params  # 2 ranks; a 48-element matrix and a 16-element norm each
        cuts = [c for k in range(0, numel, 64) for c in (k, k + 48)][1:]
        exact = [(k + 48, k + 64) for k in range(0, numel, 64)]
        layout = BucketLayout.build(numel, 2, 32, cuts, exact)
        x = torch.randn(numel)
        lane, padded = layout.to_lane(x), layout.to_padded(x, torch.float32)  # warm-up: indices
        counts = []
        for _ in range(2):
            with Ops() as mode:
                lane = layout.to_lane(x)
                layout.from_lane_shard(lane[:layout.exact_shard], 0, x[:layout.shard])
                padded = layout.to_padded(x, torch.float32)
                layout.from_padded_shard(padded[:layout.padded_shard], 0, x[:layout.shard])
            counts.append(mode.n)
        caches.clear()
        return counts[-1]

    assert ops(4) == ops(40)
