"""Megatron-LM training-loop glue: LoCo inside ``megatron.training``.

``startup`` (the start-up sequence every launch path shares), ``argument_hooks`` (LoCo in an
unmodified Megatron-LM ``pretrain_gpt.py``), ``iteration_log`` (LoCo figures on Megatron's
iteration line, TensorBoard, timers), ``workarounds`` (what ``megatron.training`` needs on CPU /
without Transformer Engine), and the entry modules: ``pretrain_gpt`` (the main job,
``run_pretrain.sh``) and ``run_megatron_lm`` (the wrapper around a user's checkout).
The top layer (docs/architecture.md).
"""
