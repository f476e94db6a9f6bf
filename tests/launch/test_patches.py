"""``patches/``: each patch applies to its Megatron-LM release tag (``patches/apply.sh``), and the
patched core_v0.19.0 ``pretrain_gpt.py`` trains 2 CPU ranks with LoCo.

Tags are extracted from a local git mirror of NVIDIA/Megatron-LM (skipped without one); with
``$MEGATRON_LM`` set, its ``pretrain_gpt.py`` is checked on a copy, the clone is never modified.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.megatron_lm_checkouts import CPU_FLAGS, ROOT, TINY_GPT, extract_tag, torchrun

PATCHES = sorted((ROOT / "patches").glob("*.patch"))
APPLY = ["bash", str(ROOT / "patches" / "apply.sh")]
CALL = "loco_megatron.enable_megatron_lm()"


def _apply(*args):
    proc = subprocess.run([*APPLY, *map(str, args)], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def test_patches_cover_16_and_newest_tag():
    assert {"core_v0.16.1", "core_v0.19.0"} <= {p.stem for p in PATCHES}


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_patch_checks_and_applies_to_its_tag(patch, tmp_path):
    checkout = extract_tag(patch.stem, tmp_path / "mlm", ["pretrain_gpt.py"])
    original = (checkout / "pretrain_gpt.py").read_text()
    rc, out = _apply(checkout, "--check", "--tag", patch.stem)
    assert rc == 0 and f"{patch.name} applies cleanly" in out, out
    assert (checkout / "pretrain_gpt.py").read_text() == original  # --check changes nothing
    rc, out = _apply(checkout, "--tag", patch.stem)
    assert rc == 0 and f"applied {patch.name}" in out, out
    patched = (checkout / "pretrain_gpt.py").read_text()
    assert patched.count(CALL) == 1
    assert patched.index(CALL) < patched.index("import torch\n")  # before megatron is imported
    rc, out = _apply(checkout, "--check", "--tag", patch.stem)
    assert rc == 0 and "already patched" in out, out
    assert (checkout / "pretrain_gpt.py").read_text() == patched  # applied once only


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_checkout_inside_another_repository_is_patched(tmp_path):
    """git apply run from a subdirectory of an enclosing repository skips the file silently;
    apply.sh must patch it (or fail), never report success for nothing."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    checkout = extract_tag("core_v0.16.1", tmp_path / "Megatron-LM", ["pretrain_gpt.py"])
    rc, out = _apply(checkout, "--tag", "core_v0.16.1")
    assert rc == 0 and "applied core_v0.16.1.patch" in out, out
    assert (checkout / "pretrain_gpt.py").read_text().count(CALL) == 1


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_tag_found_by_git_describe(tmp_path):
    """A git clone at a release tag: apply.sh picks that tag's patch by itself."""
    checkout = extract_tag("core_v0.16.1", tmp_path / "mlm", ["pretrain_gpt.py"])
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"], ["tag", "core_v0.16.1"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    rc, out = _apply(checkout, "--check")
    assert rc == 0 and "core_v0.16.1.patch applies cleanly" in out, out


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_unknown_tag_falls_back_to_a_patch_that_applies(tmp_path):
    checkout = extract_tag("core_v0.19.0", tmp_path / "mlm", ["pretrain_gpt.py"])
    rc, out = _apply(checkout, "--check", "--tag", "core_v9.9.9")
    assert rc == 0 and "no patch for tag 'core_v9.9.9'" in out
    assert "core_v0.19.0.patch applies cleanly" in out  # newest first


def test_apply_refuses_a_directory_without_pretrain_gpt(tmp_path):
    rc, out = _apply(tmp_path, "--check")
    assert rc == 2 and "pretrain_gpt.py not found" in out


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM"), reason="MEGATRON_LM is not set")
def test_a_patch_applies_to_the_users_clone(tmp_path):
    shutil.copy(Path(os.environ["MEGATRON_LM"]) / "pretrain_gpt.py", tmp_path)
    package_info = Path(os.environ["MEGATRON_LM"]) / "megatron" / "core" / "package_info.py"
    if package_info.exists():
        (tmp_path / "megatron" / "core").mkdir(parents=True)
        shutil.copy(package_info, tmp_path / "megatron" / "core")
    rc, out = _apply(tmp_path, "--check")
    assert rc == 0, out


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_patched_v0_19_pretrain_gpt_trains_with_loco(tmp_path):
    """The user's way after patching: torchrun pretrain_gpt.py from the checkout, plus
    --loco-bits 4; no wrapper, and no CPU flags: the patched script adds them on CPU ranks."""
    checkout = extract_tag("core_v0.19.0", tmp_path / "mlm")
    assert _apply(checkout, "--tag", "core_v0.19.0")[0] == 0
    assert not set(CPU_FLAGS) & set(TINY_GPT)
    rc, out = torchrun(["pretrain_gpt.py"], [*TINY_GPT, "--use-distributed-optimizer",
                                             "--loco-bits", "4"], cwd=checkout,
                    preloaded=False)  # the checkout's own megatron package
    assert rc == 0, out[-6000:]
    assert out.count("added the CPU-compatible settings you did not set: --distributed-backend "
                     "gloo") == 1, out[-6000:]
    assert "> LoCo active: 4-bit compensated reduce-scatter" in out
    assert len([ln for ln in out.splitlines() if " iteration " in ln and "lm loss" in ln]) == 3
