"""Alpha-beta times of the collectives, and how much of them hides behind compute.

Alpha-beta model (Hockney; Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1)): a message of ``n`` bytes takes
``alpha + n * beta`` seconds, ``beta = 1 / bandwidth``. For ``p`` ranks and ``n`` bytes of
buffer per rank:

* ring reduce-scatter and ring all-gather: ``(p - 1) * alpha + (p - 1) / p * n * beta``;
* ring all-reduce (reduce-scatter + all-gather): ``2 (p - 1) alpha + 2 (p - 1) / p * n * beta``;
* pairwise all-to-all (``p - 1`` rounds): ``(p - 1) * alpha + (p - 1) / p * n * beta``.

The bytes a rank sends, ``(p - 1) / p * n``, are passed in exactly (LoCo's own counts, with
padding). Which ``beta``: a group of ``p = M * L`` ranks on ``M`` nodes, ``L`` per node
(:class:`~.cluster.GroupSpread`). Inside one node (``M == 1``): the GPU's intra-node bandwidth.
Across nodes a ring enters and leaves each node once per step, so every ring edge carries the
same bytes and the slowest edge sets the pace: the node boundary, which the group's ``L`` GPUs
share (their NICs' share, ``L * b_gpu``), or an intra-node edge: ``min(L * b_gpu, b_intra)``,
with the inter-node ``alpha``. A pairwise all-to-all sends ``(M - 1) / M`` of a rank's data to
other nodes at that rank's own NIC share ``b_gpu`` and ``(L - 1) / p`` inside the node, at the
same time: the larger of the two times.
"""

from typing import List, Sequence

from .cluster import ClusterSpec, GroupSpread


def ring_time(p: int, sent_bytes: float, alpha_s: float, bytes_per_s: float) -> float:
    """Ring reduce-scatter or all-gather (Thakur et al. 2005, Sec. 4): ``(p-1) alpha +
    sent_bytes / bandwidth`` seconds, ``sent_bytes = (p-1)/p * n`` per rank. 0 for ``p == 1``."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha_s + sent_bytes / bytes_per_s


def ring_allreduce_time(p: int, sent_bytes: float, alpha_s: float, bytes_per_s: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather: ``2 (p-1) alpha + 2 sent_bytes / bw``
    seconds, ``sent_bytes = (p-1)/p * n`` (Thakur et al. 2005; Patarasuk & Yuan 2009)."""
    return 2 * ring_time(p, sent_bytes, alpha_s, bytes_per_s)


def _ring_link(g: GroupSpread, c: ClusterSpec):
    """``(alpha seconds, bottleneck bytes/s)`` of a ring over group ``g``."""
    if g.nodes <= 1:
        return c.intra_node_latency_us * 1e-6, c.intra_bytes_per_s
    bw = g.per_node * c.inter_bytes_per_s_per_gpu
    if g.per_node > 1:
        bw = min(bw, c.intra_bytes_per_s)
    return c.inter_node_latency_us * 1e-6, bw


def ring_collective(g: GroupSpread, c: ClusterSpec, sent_bytes: float,
                    allreduce: bool = False) -> float:
    """Seconds of a ring reduce-scatter / all-gather (or all-reduce) over group ``g`` where
    each rank sends ``sent_bytes`` (per phase)."""
    alpha, bw = _ring_link(g, c)
    return (ring_allreduce_time if allreduce else ring_time)(g.size, sent_bytes, alpha, bw)


def alltoall_time(g: GroupSpread, c: ClusterSpec, sent_bytes: float) -> float:
    """Seconds of a pairwise all-to-all over group ``g``: each rank sends ``sent_bytes``
    (``(p-1)/p`` of its buffer) spread evenly over the ``p - 1`` others; the inter-node part at
    the rank's NIC share, the intra-node part over the intra-node link, concurrently."""
    p = g.size
    if p <= 1:
        return 0.0
    per_peer = sent_bytes / (p - 1)
    if g.nodes <= 1:
        return (p - 1) * c.intra_node_latency_us * 1e-6 + sent_bytes / c.intra_bytes_per_s
    inter = per_peer * (p - g.per_node) / c.inter_bytes_per_s_per_gpu
    intra = per_peer * (g.per_node - 1) / c.intra_bytes_per_s
    return (p - 1) * c.inter_node_latency_us * 1e-6 + max(inter, intra)


def exposed_after_window(ready_s: Sequence[float], comm_s: Sequence[float],
                         window_s: float) -> float:
    """Communication left after a compute window, for collectives issued in order on one
    stream: bucket ``i`` can start at ``ready_s[i]`` (its gradients complete, seconds into the
    window) and after bucket ``i-1`` ends. Returns ``max(0, end of the last - window_s)``.

    This is megatron-core's ``overlap_grad_reduce``: a bucket's reduce-scatter is launched by the
    backward hook of its last parameter (``start_grad_sync``), and ``finish_grad_sync`` waits for
    all of them after backward; the last bucket is never hidden.
    """
    end = 0.0
    for r, t in zip(ready_s, comm_s):
        end = max(end, r) + t
    return max(0.0, end - window_s)


def exposed_before_use(needed_s: Sequence[float], comm_s: Sequence[float]) -> float:
    """Stall of a compute phase that needs bucket ``j``'s all-gather done at ``needed_s[j]``
    (seconds into the phase), all-gathers running back to back from its start:
    ``max_j(sum_{k<=j} comm_s[k] - needed_s[j])`` (at least 0; the first bucket is exposed).

    This is megatron-core's ``overlap_param_gather``: each bucket's parameter all-gather is
    waited on by the forward pre-hook of its first parameter.
    """
    done, stall = 0.0, 0.0
    for need, t in zip(needed_s, comm_s):
        done += t
        stall = max(stall, done - need)
    return stall


def forward_needs(ready: Sequence[float], window_s: float) -> List[float]:
    """Seconds into a forward window of ``window_s`` at which each bucket (given by its
    backward-order ``ready`` fraction) is first needed: ``(1 - ready) * window_s`` -- the
    forward runs through the buckets in the reverse of backward order."""
    return [(1.0 - r) * window_s for r in ready]
