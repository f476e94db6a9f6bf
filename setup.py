"""loco-megatron: LoCo low-bit gradient reduce-scatter as a megatron-core plugin."""

from setuptools import find_packages, setup

setup(
    name="loco-megatron",
    version="0.1.0",
    description="LoCo compensated 4-bit gradient reduce-scatter for Megatron (arXiv 2407.04480)",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["loco_megatron", "loco_megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch.accelerator (patched by the CPU emulation) exists from 2.6; CI tests 2.13 and 2.14
        "torch>=2.6",
        # Supported range (docs/compatibility.md): 0.19.x on Python 3.12 (with megatron.training),
        # 0.13.x-0.16.x on Python 3.11 (the plugin; the main job needs a Megatron-LM checkout).
        # install.sh pins 0.19.x by default, MCORE_VERSION=... for the other legs.
        "megatron-core>=0.13,<0.20",
        "numpy",
        "PyYAML",
        "tokenizers",
        # What megatron.training imports but megatron-core does not declare.
        "transformers",  # HuggingFaceTokenizer (loads our locally trained tokenizer)
        "einops",
        "six",
        "regex",
        "tqdm",
        "pydantic",
        "psutil",  # checkpoint saving
        "tensorboard",  # --tensorboard-dir (megatron.training writes it when importable)
        "pybind11",  # building the dataset helper when megatron.training compiles it
    ],
    # Optional GPU extras. Transformer Engine: `pip install -e ".[te]"` (builds against the local
    # CUDA toolkit). NVIDIA apex is NOT offered here and must never be installed from the package
    # index: the index's `apex` is an unrelated project. Build apex from NVIDIA's source,
    # https://github.com/NVIDIA/apex, with CUDA (see its README; docs/compatibility.md). The plugin
    # works with or without either: it acts on megatron-core's gradient buffer.
    extras_require={
        "test": ["pytest", "hypothesis"],
        "bench": ["matplotlib"],  # benchmarks/ (python -m benchmarks): the convergence plot
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["loco-megatron = loco_megatron.cli.command:main"]},
)
