"""loco-megatron benchmark suite (BENCHMARKS.md): ``python -m benchmarks``."""
