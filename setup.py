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
        "torch>=2.4",
        "megatron-core>=0.19,<0.20",
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
    extras_require={
        "test": ["pytest", "hypothesis"],
    },
    entry_points={"console_scripts": []},
)
