"""One-shot check of this repository on a machine with one NVIDIA GPU (docs/gpu_check.md).

    bash benchmarks/gpu_check.sh [--out benchmarks/results/gpu_check.md] [--budget 460]
                                 [--only throughput kernels compile pytest pretrain] [--logs DIR]

Steps, each a child process with its own timeout inside a total budget (a step that overruns
is killed with its process group and reported as timed out; the others still run):

1. ``throughput``: Triton compress/decompress GB/s for fp32 and bf16 buckets of 64-512 MiB
   against the device's copy bandwidth (benchmarks/gpu_check_kernels.py);
2. ``kernels``: the Triton kernels bit-identical to the torch reference on CUDA tensors;
3. ``compile``: ``python -m loco_megatron.kernels.compile_check`` (every kernel variant for
   sm_80 and sm_90 with Triton's ptxas: no spill, 64-bit addresses; CI's subset);
4. ``pytest``: ``pytest -m gpu tests``, its summary parsed (among them two ranks sharing the
   GPU over gloo with the Triton kernels, and a decompress above 2^31 elements);
5. ``pretrain``: the main job, ``run_pretrain.sh --bf16 --loco-bits 4 --train-iters 50`` on
   one GPU, its log parsed.

Writes one report (markdown, and the same as JSON beside it) to ``--out``; step logs go to
``--logs`` (default runs/gpu_check-<time>/). Exit status 0 when every step passed, 1 otherwise.
Without a GPU (nvidia-smi missing, or torch.cuda.is_available() false in a fresh Python that
has not imported loco_megatron, so its CPU emulation of CUDA cannot answer) it prints one line
and exits 0, writing nothing. Standard library only in this process: the GPU work runs in the
children.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional

from . import gpu_check_report as report

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.md"
DEFAULT_BUDGET_S = 460  # the probe and every step inside it; + the last kill and the report
KILL_GRACE_S = 5  # a timed-out step's process group: SIGTERM, this long, SIGKILL, this long
PRETRAIN_ITERS = 50
#: step -> (longest timeout s, time kept for it while earlier steps run s)
STEPS = {"throughput": (120, 45), "kernels": (120, 45), "compile": (120, 30),
         "pytest": (150, 60), "pretrain": (300, 150)}
#: the compile check's command (loco_megatron/kernels/compile_check.py; CI's subset here, the
#: whole matrix is ``--subset all``)
COMPILE_CMD = ["-m", "loco_megatron.kernels.compile_check", "--arch", "sm_80", "sm_90",
               "--subset", "ci"]
PROBE_TIMEOUT_S = 60

_PROBE = r"""
import json, platform, sys
info = {"python": platform.python_version(), "host": platform.node()}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), torch_gpu=p.name,
                    capability="%d.%d" % (p.major, p.minor),
                    torch_gpu_memory="%.1f GiB" % (p.total_memory / 2 ** 30))
except Exception as exc:
    info["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton"] = "not importable (%s)" % type(exc).__name__
try:
    from importlib.metadata import version
    info["megatron_core"] = version("megatron-core")
except Exception:
    pass
info["loco_megatron_imported"] = "loco_megatron" in sys.modules
print("GPU_CHECK_PROBE " + json.dumps(info))
"""


def _env() -> Dict[str, str]:
    """The children's environment: never the Triton interpreter, the repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCO_DRY_RUN")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") \
        else str(ROOT)
    return env


def nvidia_smi() -> Dict:
    """``{"gpu", "driver", "gpu_memory", "driver_cuda"}`` from nvidia-smi, or ``{"error"}``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    try:
        q = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        plain = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"nvidia-smi failed: {exc}"}
    if q.returncode or not q.stdout.strip():
        return {"error": f"nvidia-smi failed (exit {q.returncode}): "
                         f"{(q.stderr or q.stdout).strip()[:200]}"}
    first = [x.strip() for x in q.stdout.strip().splitlines()[0].split(",")]
    out = dict(zip(("gpu", "driver", "gpu_memory"), first))
    out["gpu_count"] = len(q.stdout.strip().splitlines())
    for tok in plain.stdout.split("CUDA Version:")[1:2]:
        out["driver_cuda"] = tok.split()[0]
    return out


def torch_probe(python: str) -> Dict:
    """torch/triton facts from a fresh Python that imports no loco_megatron."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=_env(), cwd="/")
    except (OSError, subprocess.SubprocessError) as exc:
        return {"torch_error": f"probe failed: {exc}"}
    for line in proc.stdout.splitlines():
        if line.startswith("GPU_CHECK_PROBE "):
            return json.loads(line.split(" ", 1)[1])
    return {"torch_error": f"probe exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}


def no_gpu_reason(smi: Dict, probe: Dict) -> Optional[str]:
    """None when both nvidia-smi and torch see a GPU, else why not (one line)."""
    why = []
    if "error" in smi:
        why.append(smi["error"])
    if probe.get("torch_error") == "not probed":
        pass
    elif "torch_error" in probe:
        why.append(f"torch: {probe['torch_error']}")
    elif not probe.get("cuda_available"):
        why.append("torch.cuda.is_available() is False")
    elif probe.get("loco_megatron_imported", True):
        why.append("the torch probe imported loco_megatron, whose CPU emulation of CUDA could "
                   "have answered")
    return "; ".join(why) or None


def step_timeout(name: str, remaining: float, later: List[str]) -> float:
    """The step's timeout: its own cap, less what the later steps are guaranteed."""
    return max(0.0, min(STEPS[name][0], remaining - sum(STEPS[s][1] for s in later)))


def run_child(cmd: List[str], log: Path, timeout: float, env=None) -> Dict:
    """Run ``cmd`` in its own process group, output to ``log``; on timeout the group gets
    SIGTERM, then SIGKILL ``KILL_GRACE_S`` later. ``{"rc", "seconds", "timed_out"}``."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env or _env(), start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "timed_out": timed_out}


def install_stale_reason(root: Path = ROOT, env=None) -> Optional[str]:
    """Why ``bash install.sh`` (which run_pretrain.sh runs first) would reinstall, by its own
    test (stamp missing, pyproject.toml, setup.py or install.sh newer, other versions asked
    for); None when it is a no-op."""
    env = os.environ if env is None else env
    venv = root / env.get("VENV", ".venv")
    stamp = venv / ".loco-installed"
    if not stamp.is_file():
        return f"{os.path.relpath(stamp, root)} is missing"
    for f in ("pyproject.toml", "setup.py", "install.sh"):  # a missing one is not newer
        if (root / f).is_file() and (root / f).stat().st_mtime > stamp.stat().st_mtime:
            return f"{f} is newer than {os.path.relpath(stamp, root)}"
    mc, tv = env.get("MCORE_VERSION", ""), env.get("TORCH_VERSION", "")
    want = (f"megatron-core=={mc} " if mc else "") + (f"torch=={tv}" if tv else "")
    if stamp.read_text() != want:
        return f"{os.path.relpath(stamp, root)} records {stamp.read_text()!r}, not {want!r}"
    return None


def _skip_install_shim(logs: Path) -> Path:
    """A folder with a ``bash`` that skips exactly ``bash install.sh`` (run_pretrain.sh's first
    line) and runs everything else with the real bash."""
    real = shutil.which("bash") or "/bin/bash"
    shim = logs / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "bash").write_text(
        f"#!{real}\nif [ \"$#\" -eq 1 ] && [ \"$1\" = install.sh ]; then\n"
        f"  echo 'gpu_check: bash install.sh skipped' >&2; exit 0\nfi\nexec {real} \"$@\"\n")
    (shim / "bash").chmod(0o755)
    return shim


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernel_step(what: str, logs: Path, timeout: float, sizes: List[int]) -> Dict:
    out = logs / f"{what}.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check_kernels", what, "--json", str(out)]
    if what == "throughput":
        cmd += ["--sizes-mib", *map(str, sizes)]
    r = run_child(cmd, logs / f"{what}.log", timeout)
    data = json.loads(out.read_text()) if out.is_file() else None
    if r["timed_out"]:
        r["status"] = "timeout"
    elif r["rc"] or data is None:
        r["status"] = "error"
    elif what == "throughput":
        r["status"] = "fail" if data["errors"] or not data["rows"] else "ok"
    else:
        r["status"] = "pass" if data["cases"] and all(c["ok"] for c in data["cases"]) else "fail"
    if data is not None:
        r["data"] = data
    if r["status"] in ("error", "timeout"):
        r["note"] = _tail(logs / f"{what}.log")
    return r


def _tail(log: Path, n: int = 3) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return "Last lines of the log: " + " / ".join(lines[-n:])[-600:] if lines else ""


def _compile_step(logs: Path, timeout: float) -> Dict:
    log = logs / "compile.log"
    r = run_child([sys.executable, *COMPILE_CMD], log, timeout)
    r["status"] = "timeout" if r["timed_out"] else ("pass" if r["rc"] == 0 else "fail")
    lines = [x.rstrip() for x in log.read_text(errors="replace").splitlines()[1:] if x.strip()]
    r["data"] = {"command": "python " + " ".join(COMPILE_CMD), "rc": r["rc"],
                 "tail": lines[-25:]}
    return r


def _pytest_step(logs: Path, timeout: float) -> Dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-rfEs",
           "-p", "no:cacheprovider"]
    log = logs / "pytest.log"
    r = run_child(cmd, log, timeout)
    summary = report.parse_pytest(log.read_text(errors="replace"))
    r["status"] = report.pytest_status(r["rc"], r["timed_out"], summary)
    r["data"] = {"command": ".venv/bin/python -m pytest -q -m gpu tests -rfEs",
                 "summary": summary}
    if summary is None:
        r["note"] = _tail(log)
    return r


def _pretrain_step(logs: Path, timeout: float, iters: int, allow_install: bool) -> Dict:
    flags = ["--bf16", "--loco-bits", "4", "--train-iters", str(iters), "--log-interval", "5"]
    env = _env()
    env.update(OUT_DIR=str(logs / "pretrain"), MASTER_PORT=str(_free_port()), NPROC="1")
    stale = install_stale_reason(ROOT, env)
    if stale is None:
        install = "install.sh ran first (up to date: a no-op)"
    elif allow_install:
        install = f"install.sh ran first and reinstalled ({stale})"
    else:
        install = (f"install.sh skipped: it would have reinstalled ({stale}); the venv ran as "
                   f"installed (--allow-install lets it run)")
        env["PATH"] = f"{_skip_install_shim(logs)}{os.pathsep}{env.get('PATH', '')}"
    log = logs / "pretrain.log"
    r = run_child([shutil.which("bash") or "/bin/bash", "run_pretrain.sh", *flags], log,
                  timeout, env)
    parsed = report.parse_pretrain(log.read_text(errors="replace"))
    r["status"] = report.pretrain_status(r["rc"], r["timed_out"], parsed, iters)
    r["data"] = {"command": "NPROC=1 bash run_pretrain.sh " + " ".join(flags), "iters": iters,
                 "install": install, "parsed": parsed}
    return r


def machine_info(smi: Dict, probe: Dict) -> Dict:
    m = {k: probe.get(k) for k in ("torch", "torch_cuda", "triton", "megatron_core", "python",
                                   "host")}
    m["gpu"] = smi.get("gpu") or probe.get("torch_gpu")
    if probe.get("capability"):
        m["gpu"] = f"{m['gpu']} (sm {probe['capability']}, {probe.get('device_count')} visible)"
    m.update(gpu_memory=smi.get("gpu_memory") or probe.get("torch_gpu_memory"),
             driver=smi.get("driver"), driver_cuda=smi.get("driver_cuda"))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
        m["commit"] = (head or "?") + (" (with uncommitted changes)" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        m["commit"] = "?"
    return m


def main(argv=None) -> int:
    t0 = time.monotonic()
    p = argparse.ArgumentParser(prog="bash benchmarks/gpu_check.sh",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="report (markdown; JSON beside it), default %(default)s")
    p.add_argument("--logs", type=Path, default=None,
                   help="step logs, default runs/gpu_check-<time>/")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="total seconds for all steps (default %(default)s)")
    p.add_argument("--only", nargs="+", choices=list(STEPS), default=list(STEPS))
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--iters", type=int, default=PRETRAIN_ITERS)
    p.add_argument("--allow-install", action="store_true",
                   help="let run_pretrain.sh's install.sh reinstall when it finds the venv stale")
    args = p.parse_args(argv)
    cwd = Path(os.environ.get("GPU_CHECK_CWD", os.getcwd()))
    smi = nvidia_smi()
    # no nvidia-smi settles it (and saves importing torch); else torch must agree
    probe = {"torch_error": "not probed"} if "error" in smi else torch_probe(sys.executable)
    why = no_gpu_reason(smi, probe)
    if why:
        print(f"gpu_check: no GPU on this machine ({why}); nothing to check", flush=True)
        return 0
    out = args.out if args.out.is_absolute() else cwd / args.out
    logs = args.logs or ROOT / "runs" / f"gpu_check-{datetime.now():%Y%m%d-%H%M%S}"
    logs = logs if logs.is_absolute() else cwd / logs
    logs.mkdir(parents=True, exist_ok=True)
    res = {"command": "bash benchmarks/gpu_check.sh " + " ".join(argv or sys.argv[1:]),
           "started": datetime.now().isoformat(timespec="seconds"), "budget_s": args.budget,
           "machine": machine_info(smi, probe), "logs": str(logs), "steps": {}}
    steps = [s for s in STEPS if s in args.only]  # always in this order
    for i, name in enumerate(steps):
        remaining = args.budget - (time.monotonic() - t0)
        timeout = step_timeout(name, remaining, steps[i + 1:])
        print(f"gpu_check: [{i + 1}/{len(steps)}] {name} (timeout {timeout:.0f} s) ...",
              file=sys.stderr, flush=True)
        try:
            if timeout < 10:
                r = {"status": "skipped", "note": "the total budget was spent"}
            elif name == "pytest":
                r = _pytest_step(logs, timeout)
            elif name == "pretrain":
                r = _pretrain_step(logs, timeout, args.iters, args.allow_install)
            elif name == "compile":
                r = _compile_step(logs, timeout)
            else:
                r = _kernel_step(name, logs, timeout, args.sizes_mib)
        except Exception as exc:  # a fault of this script's glue: report it, run the rest
            r = {"status": "error", "note": f"gpu_check: {type(exc).__name__}: {exc}"[:600]}
        r["timeout_s"] = round(timeout)
        if "seconds" in r:
            r["log"] = os.path.relpath(logs / f"{name}.log", out.parent)
        res["steps"][name] = r
        print(f"gpu_check: {name}: {report.status_word(r)} ({r.get('seconds', 0):.0f} s)",
              file=sys.stderr, flush=True)
        res["seconds"] = round(time.monotonic() - t0, 1)
        report.write_report(res, out)  # after every step: a killed run still leaves a report
    statuses = {n: r["status"] for n, r in res["steps"].items()}
    print(f"gpu_check: report {out} ("
          + ", ".join(f"{n} {s}" for n, s in statuses.items()) + f") in {res['seconds']:.0f} s")
    return 0 if all(s in ("ok", "pass") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
