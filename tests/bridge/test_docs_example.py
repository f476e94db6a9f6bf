"""docs/megatron_bridge.md's complete recipe runs as written on 2 CPU ranks: its
``tiny_bridge.py`` and ``tiny_bridge.yaml`` blocks are written to a folder and its command is run
there (the repository paths in it made absolute)."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "megatron_bridge.md"


def _blocks(text: str, lang: str):
    return re.findall(r"```" + lang + r"\n(.*?)```", text, re.S)


def test_the_documented_recipe_runs_as_written(tmp_path):
    text = DOC.read_text()
    files = {block.splitlines()[0].lstrip("# ").strip(): block
             for lang in ("python", "yaml") for block in _blocks(text, lang)
             if block.startswith("# tiny_bridge.")}
    assert set(files) == {"tiny_bridge.py", "tiny_bridge.yaml"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    command = next(b for b in _blocks(text, "bash") if "tiny_bridge.py" in b)
    venv = Path(os.environ.get("VIRTUAL_ENV") or Path(os.sys.executable).parents[1])
    command = (command.replace("tests/bridge/stand_ins", str(ROOT / "tests/bridge/stand_ins"))
               .replace(".venv-bridge/bin/python", os.sys.executable))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert out.count("> LoCo active: 4-bit compensated reduce-scatter") == 1
    assert "> LoCo parameter all-gather: 4-bit weight differences" in out
    assert re.search(r"iteration\s+6/\s+6 \|", out), out[-4000:]  # train_iters from the YAML
    assert "(0.129x)" in out
    tb = list((tmp_path / "runs" / "tiny_bridge" / "tb").glob("events.*"))
    assert tb, "no TensorBoard events"
