"""Default corpus, local tokenizer training and JSONL -> Megatron indexed dataset (docs/data.md).

Modules: ``corpus`` (document readers), ``sources`` (corpus selection), ``tokenizer``
(byte-level BPE training/saving), ``indexed`` (``.bin``/``.idx`` writing), ``cache``
(cache directory, manifest, atomic publish), ``progress`` and ``prepare`` (the CLI:
``python -m loco_megatron.data.prepare``).
"""
