"""Default corpus, local tokenizer training and JSONL -> Megatron indexed dataset (DESIGN.md §6)."""
