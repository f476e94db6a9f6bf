"""No code, test or tool finds things through one particular machine's paths: Megatron-LM
checkouts come from ``$MEGATRON_LM`` or ``$LOCO_MEGATRON_LM_MIRROR`` (tests/README.md)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIRS = ("loco_megatron", "tests", "tools", "benchmarks", "slurm", "configs")
#: prefixes of paths that exist only on the machines this project was developed on
MACHINE_PATHS = ("/work/.mirror", "/work/main", "/work/.library", "/opt/pypi")


def _sources():
    for d in DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in (".py", ".sh", ".yaml", ".yml") and path.is_file():
                yield path
    for name in ("run_pretrain.sh", "install.sh", "setup.py", "pyproject.toml", ".ci/run"):
        yield ROOT / name


@pytest.mark.parametrize("prefix", MACHINE_PATHS)
def test_no_source_names_a_development_machine_path(prefix):
    this = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in _sources() if p.resolve() != this
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if prefix in line]
    assert hits == [], f"{prefix} in {hits}: read the location from an environment variable"
