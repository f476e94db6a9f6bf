"""LoCo's memory with overlap on and off, measured and equal to the formula (docs/kernels.md,
"GPU contract", memory): under the CPU emulation, the allocation tracker's live bytes of LoCo in
a steady step of the tiny GPT (2 DP ranks, 4 bits, int8 error storage, C kernels) at 1, 4 and
17 buckets (:data:`BUCKET_SIZES`), with ``overlap_grad_reduce`` on and off, against
:func:`loco_megatron.step_memory.step_memory`: persistent bytes (error buffers, block tables
with their spans, NaN/Inf counters) and the step's peak (overlap on: every bucket's send and
receive buffers at the end of backward when none has landed, one bucket's when each has landed
by the next launch and LoCo finished and freed it then (``collectives.InFlight``); off: one
bucket's), within 1% (they are equal to the byte here), and the start-up line's persistent
figure; and the 4 buckets in one bucket group (as megatron groups them with fp8 parameters and
in virtual-pipeline chunks after the first): the group's buckets are all in flight at once. The
ten cases run in one launch of 2 ranks."""

from .worker_memory import memory_worker

#: buckets -> megatron's bucket_size (elements) that makes them, for the one-layer tiny GPT
#: (~60k parameters). megatron cuts buckets at parameter boundaries only: at bucket_size 1 each
#: of its 17 parameters is a bucket, and no bucket size gives exactly 16
BUCKET_SIZES = {1: 10**8, 4: 10000, 17: 1}
#: overlap off; overlap on with no all-to-all landed before the end of backward (the bound),
#: and with each landed by the next launch (then finished and freed: collectives.InFlight)
CASES = [(size, overlap, landed, False) for size in BUCKET_SIZES.values()
         for overlap, landed in ((False, None), (True, "none"), (True, "all"))]
#: the 4 buckets in one bucket group (megatron's fp8 and later-virtual-chunk grouping), each
#: group landed by the next launch: a group launches all its buckets before LoCo can finish one
GROUPED = (BUCKET_SIZES[4], True, "all", True)


def test_memory_matches_formula_with_overlap_on_and_off(run_ranks):
    results = run_ranks(memory_worker, 2, CASES + [GROUPED])
    for res in results:
        for (size, overlap, landed, one_group), case in zip(CASES + [GROUPED], res):
            mem = case["formula"]
            want = next(k for k, v in BUCKET_SIZES.items() if v == size)
            where = (want, overlap, landed, one_group, case["at_peak"])
            assert case["buckets"] == want and case["groups"] == (1 if one_group else want), where
            assert abs(case["persistent"] - mem.persistent) <= 0.01 * mem.persistent, (
                case["persistent"], mem, where)
            assert abs(case["peak"] - mem.peak) <= 0.01 * mem.peak, (case["peak"], mem, where)
            assert case["logged"] in (None, mem.persistent)  # printed on rank 0 only
            if overlap:  # built with overlap on: the line states overlap on's range
                assert case["logged_transient"] in (None, case["span"]), where
        # 17 buckets: with none landed every bucket's wire buffers are live at once; with each
        # landed by the next launch, one bucket's, as without overlap
        off, none, every = (c["formula"] for c in res[-4:-1])
        assert none.transient == none.wire_all > every.transient == off.transient
        assert res[-3]["peak"] > res[-2]["peak"]
        # one group of 4 buckets: all 4 in flight at once, though each group lands in time
        assert res[-1]["formula"].transient == res[-1]["formula"].wire_all
    assert results[0][0]["logged"] == results[0][0]["formula"].persistent
    assert results[0][-1]["logged_transient"] == results[0][-1]["span"]
