"""Benchmark report: one JSON file and one markdown file from the sections' results.

Each section module in :mod:`benchmarks` has ``run(quick: bool, workdir: Path) -> Section``; the
report keeps the sections in the order they ran, with the machine they ran on.
"""

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence


@dataclass
class Section:
    """One benchmark's result.

    Attributes:
        name: short id (the module name: ``wire_bytes``, ``throughput``, ...).
        title: heading in the markdown report.
        markdown: the section's body (tables, notes), without the heading.
        data: JSON-serialisable numbers behind the tables.
        seconds: wall time the section took (filled in by the runner).
        skipped: reason when the section could not run here (e.g. no root), else "".
        files: extra files the section wrote (e.g. a PNG plot), relative to the report folder.
    """

    name: str
    title: str
    markdown: str = ""
    data: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str = ""
    files: List[str] = field(default_factory=list)


def machine() -> Dict[str, Any]:
    """The machine the numbers come from: CPU, cores, memory, GPU, library versions."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "cpu": _cpu_model(), "mem_gib": _mem_gib(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    for mod in ("megatron.core", "triton"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod.split(".")[0] if mod == "triton" else "megatron_core"] = getattr(
                m, "__version__", "?")
        except ImportError:
            pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True,
                                            cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_gib() -> float:
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        return round(kb / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def write(sections: List[Section], out_dir: Path, argv: List[str],
          pending: Sequence[str] = ()) -> Path:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; returns the markdown path.

    ``pending``: sections of the same run still to come (the runner rewrites the report after
    every section, so a long run's first results can be read while it goes on); the report
    says the run is in progress and ``report.json`` lists them under ``"pending"``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    command = "python -m benchmarks " + " ".join(argv)
    payload = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "machine": info, "sections": [asdict(s) for s in sections],
               "pending": list(pending)}
    (out_dir / "report.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    lines = ["# loco-megatron benchmark report", "",
             f"Command: `{command.strip()}`  ", f"Date: {payload['date']}  ",
             "Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), ""]
    if pending:
        lines += [f"**In progress: sections {', '.join(pending)} still running.**", ""]
    if "--quick" in argv:
        lines += ["**Quick run (`--quick`): a smoke test at toy sizes. Its numbers, ratios and "
                  "'met' lines are not evidence of anything.**", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.skipped:
            lines += [f"Skipped: {s.skipped}", ""]
        lines += [s.markdown.rstrip(), "", f"_({s.seconds:.0f} s)_", ""]
    md = out_dir / "report.md"
    md.write_text("\n".join(lines))
    return md
