"""Printing a plan (:func:`loco_megatron.planner.predict.plan`'s dict): a header, one table row
per variant, and a headline verdict. All times are predictions of the model in docs/planner.md.
"""

import json
from typing import Dict, List

#: a LoCo variant "pays" when its predicted step time is at least this much below stock
PAYS_BELOW = 0.98


def fmt_bytes(n) -> str:
    """Bytes as ``12.3 GiB`` / ``45.6 MiB`` / ``7 B``; ``-`` for None."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def best_loco(p: Dict) -> Dict:
    """The LoCo variant with the lowest predicted step time."""
    return min((v for v in p["variants"] if v["bits"]), key=lambda v: v["step_ms"])


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def headline(p: Dict) -> str:
    """One sentence: does LoCo pay here, and by how much (prediction); with an fp32 reference
    also what stock with a bf16 gradient reduce-scatter would give."""
    b, ref = best_loco(p), _ref(p)
    bf16 = next(v for v in p["variants"] if v["name"] == "stock bf16")
    alt = ("" if ref is bf16 else
           f" Stock with --grad-reduce-in-bf16: ratio {bf16['ratio_to_stock']:.3f}.")
    groups = [p["dense_group"]] + ([p["expert_group"]] if p["expert_group"] else [])
    if all(g["size"] == 1 for g in groups):
        return ("Data-parallel size 1: no gradient is communicated, so LoCo runs megatron's "
                "stock path and changes nothing here.")
    if ref is not bf16 and b["ratio_to_stock"] >= bf16["ratio_to_stock"]:
        alt = (f" But stock with --grad-reduce-in-bf16 is predicted as fast or faster (ratio "
               f"{bf16['ratio_to_stock']:.3f}, no compression): try that first.")
    if b["ratio_to_stock"] < PAYS_BELOW:
        return (f"LoCo pays: {b['name']} predicts {_ms(b['step_ms'])} ms/step vs "
                f"{_ms(ref['step_ms'])} ms for {p['stock_reference']} "
                f"(ratio {b['ratio_to_stock']:.3f}, {100 * (1 - b['ratio_to_stock']):.1f}% "
                f"faster; prediction).{alt}")
    return (f"LoCo does not pay here: the best variant, {b['name']}, predicts ratio "
            f"{b['ratio_to_stock']:.3f} to {p['stock_reference']} ({_ms(ref['step_ms'])} "
            f"ms/step, of which {_ms(ref['step_exposed_comm_ms'])} ms exposed communication); "
            f"the step is compute-bound or the links are fast enough.{alt}")


def _ref(p: Dict) -> Dict:
    return next(v for v in p["variants"] if v["name"] == p["stock_reference"])


def header_lines(p: Dict) -> List[str]:
    """Model, layout, placement and compute lines above the table."""
    dg = p["dense_group"]
    lines = [
        f"model: {p['params_total'] / 1e9:.2f} B parameters ({p['params_active'] / 1e9:.2f} B "
        f"active); per GPU (pipeline stage {p['stage']}): {p['params_per_gpu'] / 1e6:.1f} M "
        f"parameters in {p['buckets']} buckets"
        + (f" ({p['expert_params_per_gpu'] / 1e6:.1f} M expert)" if p["expert_group"] else ""),
        f"layout: {p['world']} GPUs = TP {p['tp']} x PP {p['pp']} x CP {p['cp']} x DP {p['dp']}"
        + (f"; EP {p['ep']}, expert TP {p['etp']}, expert DP {p['expert_dp']}"
           if p["expert_group"] else "")
        + (f"; {p['instances']} distributed-optimizer instances" if p["instances"] > 1 else ""),
        f"placement: the gradient reduce-scatter group has {dg['size']} ranks on {dg['nodes']} "
        f"node(s), {dg['per_node']} per node"
        + (f"; expert DP group {p['expert_group']['size']} ranks on {p['expert_group']['nodes']} "
           f"node(s), {p['expert_group']['per_node']} per node" if p["expert_group"] else ""),
        f"compute: {p['compute_ms']:.1f} ms per step ({p['compute_source']}), "
        f"{p['microbatches']} microbatch(es) per step; stock reduce-scatter modelled as "
        + ("an all-reduce (gloo)" if p["stock_allreduce"] else "a ring reduce-scatter"),
    ]
    return lines


COLUMNS = ("variant", "grad bytes/GPU/step", "of which leave the node", "grad comm ms",
           "comp+decomp ms", "exposed grad ms", "param AG bytes/GPU/step", "exposed param AG ms",
           "step ms", "ratio to stock", "LoCo memory/GPU")


def rows(p: Dict) -> List[List[str]]:
    """Table cells per variant (strings)."""
    out = []
    for v in p["variants"]:
        mem = "-"
        if v["bits"]:
            mem = fmt_bytes(v["error_buffer_bytes"]) + " err"
            if v["transient_wire_bytes_largest_bucket"]:
                mem += f" + {fmt_bytes(v['transient_wire_bytes_largest_bucket'])} wire"
            if v.get("param_fp32_copy_bytes"):
                mem += f" + {fmt_bytes(v['param_fp32_copy_bytes'])} fp32 main"
        ref = " (ref)" if v["name"] == p["stock_reference"] else ""
        out.append([v["name"] + ref, fmt_bytes(v["grad_bytes_sent"]),
                    fmt_bytes(v["cross_node_bytes_per_gpu"]),
                    f"{v['grad_comm_ms']:.1f}",
                    f"{v['compress_ms'] + v['decompress_ms']:.1f}",
                    f"{v['grad_exposed_ms']:.1f}", fmt_bytes(v["param_bytes_sent"]),
                    f"{v['param_all_gather_exposed_ms']:.1f}",
                    f"{v['step_ms']:.1f}", f"{v['ratio_to_stock']:.3f}", mem])
    return out


def table(p: Dict) -> str:
    """The whole printed report: header, aligned table, notes, headline."""
    cells = [list(COLUMNS)] + rows(p)
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    lines = header_lines(p) + ["", fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    lines += ["",
              "grad bytes: sent per GPU per step in the gradient reduce-scatter (LoCo: "
              "all-to-all codes + scales; hierarchical: intra- + inter-node stage); leave the "
              "node: this GPU's share of what crosses its node boundary (a ring crosses it "
              "once per node, shared by the group's GPUs there). "
              "grad comm: all buckets' collectives back to back; exposed: what overlap does "
              "not hide. param AG: the distributed optimizer's parameter all-gather ("
              "\"+ param N-bit\": --loco-param-bits N, weight differences). LoCo memory: error "
              "buffers + the largest bucket's send/receive buffers (+ fp32 main copies of fp32 "
              "parameters with --loco-param-bits). All times are predictions (alpha-beta model, docs/planner.md).",
              headline(p)]
    return "\n".join(lines)


def to_json(p: Dict) -> str:
    """The plan as indented JSON (``--json``), with the headline."""
    return json.dumps(dict(p, headline=headline(p)), indent=2)
