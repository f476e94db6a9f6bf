"""Stream placement of LoCo's asynchronous reduce-scatters, checked under the CPU emulation.

loco_megatron/streams.py, loco_megatron/emulation/stream_log.py. Gloo ranks with the emulation
active run three buckets the way megatron's backward hooks do with overlap on: the compute
stream writes a bucket, LoCo launches it, backward goes on, and ``finish_grad_sync`` waits for
every handle. The stream log replays a GPU's ordering rules and finds:

* no hazard (no read before its producer's event, no write racing another stream's access);
* every compress (both stages' when hierarchical) on a stream other than the compute stream,
  and no compute-stream wait while a bucket launches;
* hierarchical (2 nodes x 2): no intra-node all-to-all ordered after an inter-node transfer
  (two stages on one NCCL stream would queue bucket k's intra-node stage behind bucket k-1's
  inter-node stage), and no compute-stream wait that orders the compute stream after an
  inter-node transfer other than the one it waits for (waiting for an intra-node stage on the
  compute stream would, behind the shared stream).
"""

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_hierarchical import BLOCK, NUMEL, grad, layout

BUCKETS, LOCAL = 3, 2


def _summary(log, launches, local):
    """What the parent checks, as plain data (streams by name)."""
    def inter(op):
        return op.kind == "collective" and len({op.group[p] // local for p in op.peers}) > 1

    def name(op):
        return f"{op.name}#{op.seq} on {op.stream.name}"

    compute_waits = [
        (name(w.target) if w.target else None, [name(c) for c in w.covers if inter(c)])
        for w in log.ops if w.kind == "wait" and w.stream.name == "default"]
    queued = [(name(op), [name(c) for c in log.ordered_before(op) if inter(c)])
              for op in log.ops if op.kind == "collective" and not inter(op)]
    return {"hazards": log.hazards,
            "intra_behind_inter": [(op, behind) for op, behind in queued if behind],
            "compress": [name(op) for op in log.ops if op.name == "loco compress_bucket"],
            "launches": [[(op.kind, op.stream.name, op.name) for op in ops] for ops in launches],
            "compute_waits": compute_waits,
            "unneeded": [(target, [c for c in covered if c != target])
                         for target, covered in compute_waits
                         if any(c != target for c in covered)]}


def _worker(rank, world, hierarchical, intra_bits):
    from loco_megatron import LoCoConfig
    from loco_megatron.collectives import compensated_reduce_scatter
    from loco_megatron.compensator import Compensator
    from loco_megatron.emulation import cpu_cuda
    from loco_megatron.emulation.stream_log import StreamLog
    from loco_megatron.hierarchical import hierarchical_reduce_scatter

    cpu_cuda.activate()
    cfg = LoCoConfig(bits=4, block_size=BLOCK, hierarchical=hierarchical,
                     intra_node_bits=intra_bits)
    comp, lay = Compensator(cfg), layout(world)
    collective = hierarchical_reduce_scatter if hierarchical else compensated_reduce_scatter
    buckets = [torch.zeros(NUMEL, device="cuda") for _ in range(BUCKETS)]
    other = torch.zeros(NUMEL, device="cuda")  # the rest of backward
    launches, handles = [], []
    with StreamLog() as log:
        for k, bucket in enumerate(buckets):
            bucket.copy_(grad(rank, k))  # the gradient's producer, on the compute stream
            start = len(log.ops)
            out = bucket.view(world, -1)[rank]  # megatron reduce-scatters into a bucket view
            handles.append(collective(out, bucket, async_op=True, compensator=comp, key=k,
                                      layout=lay))
            launches.append(log.ops[start:])
            other.add_(bucket)  # backward goes on
        for handle in handles:  # finish_grad_sync
            handle.wait()
        total = sum(b.view(world, -1)[rank].double().sum() for b in buckets)  # the optimizer
    cpu_cuda.deactivate()
    return _summary(log, launches, LOCAL if hierarchical else world), float(total)


def _check(summary):
    assert summary["hazards"] == [], "\n".join(summary["hazards"])
    compress = summary["compress"]
    assert compress and not [c for c in compress if c.endswith(" on default")], compress
    for ops in summary["launches"]:
        assert not [op for op in ops if op[0] == "wait" and op[1] == "default"], ops
    assert summary["unneeded"] == [], summary["compute_waits"]
    assert summary["intra_behind_inter"] == []


def test_flat_compress_runs_off_the_compute_stream_in_order():
    """2 ranks; about 4 s."""
    for summary, _ in run_ranks(_worker, 2, False, 16):
        _check(summary)


@pytest.mark.parametrize("intra_bits", [16, 8])
def test_hierarchical_compute_stream_waits_only_for_what_it_reads(intra_bits):
    """4 ranks as 2 nodes x 2; about 6 s each."""
    for summary, _ in run_ranks(_worker, 4, True, intra_bits, local_world_size=LOCAL):
        _check(summary)
