"""What the benchmark runs share with ``run_pretrain.sh`` on a machine without a GPU."""

from typing import List

#: run_pretrain.sh's flags for CPU ranks (no GPU): gloo through the CUDA emulation
CPU_ARGS = ("--distributed-backend", "gloo", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
            "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm")


def corpus_args() -> List[str]:
    """``--data-path`` and tokenizer flags of the real default corpus (built once, cached)."""
    from loco_megatron.data.prepare import prepare_data

    prep = prepare_data()
    return ["--data-path", str(prep.data_prefix), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(prep.tokenizer_dir)]
