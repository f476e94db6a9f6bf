"""loco-megatron benchmark suite (DESIGN.md §8, BENCHMARKS.md): ``python -m benchmarks``."""
