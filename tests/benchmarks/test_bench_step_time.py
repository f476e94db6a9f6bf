"""benchmarks/step_time.py: namespace link set-up/teardown, rate cap, log parsing, schedule.

No training runs here (the section itself is ``python -m benchmarks --only step_time``).
"""

import os
import subprocess
import sys
import time

import pytest

from benchmarks import netns, step_time
from benchmarks.step_log import LogParser, summarize



def _link_unavailable() -> str:
    """Why no namespace link can be built here: not root, no iproute2, or creation refused."""
    why = netns.unavailable()
    if not why:
        link = netns.TwoNodeLink("100mbit", tag=9)
        try:
            link.open()
        except (subprocess.SubprocessError, OSError) as e:
            why = f"cannot build the namespace link here: {getattr(e, 'stderr', '') or e}"
        finally:
            link.close()
    return why


_WHY = _link_unavailable()
needs_root = pytest.mark.skipif(bool(_WHY), reason=_WHY or "namespaces available")

# Captured from `python -m benchmarks --only step_time --quick` (megatron-core 0.19.2, DP=2).
LOCO_LOG = """\
> LoCo: model chunk 0: 1 buckets, 2895616 gradient elements, 746592 bytes/step per rank on the wire vs 5791232 stock (0.129x)
 [2026-11-30 10:47:02.749136] iteration        3/       6 | consumed samples:            6 | elapsed time per iteration (ms): 5694.0 | learning rate: 5.000000E-05 | global batch size:     2 | lm loss: 8.921298E+00 | loss scale: 1.0 | grad norm: 12.464 | number of skipped iterations:   0 | number of nan iterations:   0 | loco compression error norm: 1.677032E+00 | loco error buffer norm: 5.169279E-01 | loco wire bytes per step: 5419128 | loco compression ratio: 7.758 |
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    forward-backward ...............................: (4840.02, 4840.98)
    all-grads-sync .................................: (3873.17, 4024.48)
    params-all-gather ..............................: (608.73, 615.95)
    optimizer ......................................: (787.71, 825.68)
    loco-compress ..................................: (1245.71, 3186.40)
    loco-comm ......................................: (124.88, 2225.48)
    loco-decompress ................................: (533.49, 534.51)
 [2026-11-30 10:47:07.227175] iteration        4/       6 | consumed samples:            8 | elapsed time per iteration (ms): 4476.9 | learning rate: 3.333333E-05 | global batch size:     2 | lm loss: 8.652111E+00 | loss scale: 1.0 | grad norm: 13.664 | number of skipped iterations:   0 | number of nan iterations:   0 | loco compression error norm: 1.912758E+00 | loco error buffer norm: 5.622619E-01 | loco wire bytes per step: 5419128 | loco compression ratio: 7.758 |
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    all-grads-sync .................................: (2471.03, 3078.49)
    params-all-gather ..............................: (651.24, 716.64)
    loco-compress ..................................: (1273.78, 1615.56)
    loco-comm ......................................: (240.95, 797.48)
    loco-decompress ................................: (592.19, 984.81)
"""
STOCK_LOG = """\
 [2026-11-30 10:48:57.315086] iteration        3/       8 | consumed samples:            6 | elapsed time per iteration (ms): 313.6 | learning rate: 6.250000E-05 | global batch size:     2 | lm loss: 9.042263E+00 | loss scale: 1.0 | grad norm: 5.324 | number of skipped iterations:   0 | number of nan iterations:   0 |
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    forward-backward ...............................: (200.70, 203.98)
    embedding-grads-all-reduce .....................: (0.02, 0.04)
    all-grads-sync .................................: (101.21, 103.50)
/work/x/cpu_cuda.py:119: UserWarning: another rank's warning in the same pipe
    params-all-gather ..............................: (75.65, 76.00)
"""


def test_parser_loco_log():
    p = LogParser().feed_text(LOCO_LOG)
    assert p.startup_bytes == (746592, 5791232)
    assert sorted(p.steps) == [3, 4]
    s3 = p.steps[3]
    assert s3.ms == 5694.0 and s3.loco_bytes == 5419128
    assert s3.timers["all-grads-sync"] == (3873.17, 4024.48)
    assert s3.timers["loco-comm"] == (124.88, 2225.48)
    summary = summarize([p.steps[3], p.steps[4]])
    assert summary["step_ms_median"] == pytest.approx((5694.0 + 4476.9) / 2)
    assert summary["all-grads-sync_ms_median"] == pytest.approx((4024.48 + 3078.49) / 2)
    assert summary["grad_sync_share"] == pytest.approx(
        summary["all-grads-sync_ms_median"] / summary["step_ms_median"])
    assert summary["loco_wire_bytes_per_step"] == 5419128
    assert summary["loco-comm_min_ms_median"] == pytest.approx((124.88 + 240.95) / 2)
    assert summary["loco_comm_share"] == pytest.approx(
        summary["loco-comm_min_ms_median"] / summary["step_ms_median"])
    assert summary["params_all_gather_share"] == pytest.approx(
        (615.95 + 716.64) / 2 / summary["step_ms_median"])


def test_parser_reads_the_parameter_all_gather_fields():
    """With --loco-param-bits the start-up line of the parameter all-gather is not summed into
    the gradient bytes, and the iteration line's param-gather bytes are read."""
    line = ("> LoCo: model chunk 0: parameter all-gather as 4-bit weight differences, 1 buckets: "
            "746592 bytes/step per rank on the wire vs 5791232 stock (0.129x); exact ...")
    it = (" iteration        3/       6 | elapsed time per iteration (ms): 10.0 | loco wire bytes "
          "per step: 7 | loco param-gather bytes per step: 9 (stock 40) |")
    p = LogParser().feed_text(LOCO_LOG.splitlines()[0] + "\n" + line + "\n" + it)
    assert p.startup_bytes == (746592, 5791232)  # the gradient line only
    assert summarize([p.steps[3]])["param_gather_bytes_per_step"] == 9


def test_parser_stock_log():
    p = LogParser().feed_text(STOCK_LOG)
    assert p.startup_bytes is None
    step = p.steps[3]
    assert step.ms == 313.6 and step.loco_bytes is None
    assert step.timers["params-all-gather"] == (75.65, 76.00)
    summary = summarize([step])
    assert summary["grad_sync_share"] == pytest.approx(103.50 / 313.6)
    assert "loco_wire_bytes_per_step" not in summary and "loco_comm_share" not in summary


def test_schedule():
    cfg = dict(step_time.CONFIG["quick"], rates=("a", "b", "c"), warmup=2, measure=3)
    assert step_time.schedule(cfg) == (13, [("a", [3, 4, 5]), ("b", [7, 8, 9]),
                                            ("c", [11, 12, 13])])
    with pytest.raises(ValueError):
        step_time.schedule(dict(cfg, warmup=1))
    for name in ("quick", "full"):  # the shipped configurations are valid
        step_time.schedule(step_time.CONFIG[name])


def test_markdown_table():
    cfg = dict(step_time.CONFIG["quick"], rates=("1gbit",), dp=(2,))
    runs = {"dp2-stock": {"error": "", "startup_bytes": None,
                          "1gbit": {"step_ms_median": 300.0, "grad_sync_share": 0.5,
                                    "params_all_gather_share": 0.2,
                                    "link_tx_bytes_per_step": 3 * 2 ** 22}},
            "dp2-loco4": {"error": "", "startup_bytes": (2 ** 19, 2 ** 22),
                          "1gbit": {"step_ms_median": 200.0, "grad_sync_share": 0.25,
                                    "loco_comm_share": 0.1, "loco_wire_bytes_per_step": 2 ** 19,
                                    "link_tx_bytes_per_step": 2 ** 19}}}
    runs["dp2-loco4+param4"] = {"error": "", "startup_bytes": (2 ** 19, 2 ** 22),
                                "1gbit": {"step_ms_median": 150.0, "params_all_gather_share": 0.1,
                                          "param_gather_bytes_per_step": 2 ** 19,
                                          "link_tx_bytes_per_step": 2 ** 20}}
    md = step_time._markdown(cfg, {"1gbit": 1.2e8}, runs, (1.5, 2.0))
    assert "| 1gbit | 2 | 300 | 200 | 1.50x | 50% | 25% (10%) | 4.00 MiB vs 0.50 MiB " \
           "| 12.00 MiB vs 0.50 MiB | 20% / ? | 150 | 2.00x | 10% | 0.50 MiB | 1.00 MiB |" in md
    assert "stock sent 12.0 MiB/step over the link, 1.50x the reduce-scatter + all-gather" in md
    assert "120 MB/s" in md and "1.5 / 2.0 on" in md


def test_skips_without_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    sec = step_time.run(quick=True, workdir=tmp_path)
    assert sec.name == "step_time" and "root" in sec.skipped


def _ours():
    return [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{os.getpid()}-")]


@needs_root
def test_link_rate_cap_and_teardown():
    with netns.TwoNodeLink("100mbit") as link:
        assert sorted(_ours()) == sorted(link.ns)
        qdisc = subprocess.run(link.exec_prefix(0) + ["tc", "qdisc", "show", "dev", link.dev[0]],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # The peer's address is reachable only inside: not from the host's namespace.
        host = subprocess.run(["ip", "route", "get", link.addr[1]], capture_output=True,
                              text=True).stdout
        assert link.dev[0] not in host
        rate = link.measure_rate(nbytes=3 * 2 ** 20)
        assert 2e6 < rate < 20e6, rate  # 100 Mbit/s = 12.5 MB/s
        link.set_rate("1gbit")
        qdisc = subprocess.run(link.exec_prefix(1) + ["tc", "qdisc", "show", "dev", link.dev[1]],
                               capture_output=True, text=True, check=True).stdout
        assert "1Gbit" in qdisc
        sleeper = link.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert _ours() == []
    assert sleeper.poll() is not None  # killed by close()
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert link.dev[0] not in links and link.dev[1] not in links
    link.close()  # idempotent


@needs_root
def test_teardown_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.TwoNodeLink("100mbit", tag=1) as link:
            proc = link.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert _ours() == [] and proc.poll() is not None


@needs_root
def test_sweeps_namespaces_of_dead_runs():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    name = f"{netns.PREFIX}{dead}-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        left = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c",
                                 "import time; time.sleep(60)"])
        for _ in range(100):  # until it has entered the namespace
            if subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.strip():
                break
            time.sleep(0.05)
        assert name in netns.sweep_stale()
        assert name not in netns.namespaces()
        assert left.wait(timeout=10) != 0  # the left-over process was killed
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_root
def test_section_without_training_runs(monkeypatch, tmp_path):
    """run() end to end with no time budget left for training: rate check, table, cleanup."""
    monkeypatch.setitem(step_time.CONFIG, "quick",
                        dict(step_time.CONFIG["quick"], section_budget_s=0))
    monkeypatch.setattr(step_time, "corpus_args", lambda: [])
    sec = step_time.run(quick=True, workdir=tmp_path)
    assert not sec.skipped
    assert set(sec.data["rate_check_bytes_per_s"]) == {"1gbit", "10gbit"}
    assert 20e6 < sec.data["rate_check_bytes_per_s"]["1gbit"] < 200e6  # 125 MB/s cap
    assert all("budget" in r["error"] for r in sec.data["runs"].values())
    assert "| 1gbit | 2 | ? | ? | ? |" in sec.markdown and "Link check" in sec.markdown
    assert _ours() == []
