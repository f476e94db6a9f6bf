"""The megatron-core seam: what loco_megatron changes inside megatron-core, and nothing else.

``plugin`` (install/uninstall: the wrapped ``start_grad_sync`` and DDP construction), ``compat``
(every megatron-core version difference, 0.13-0.19), ``loss_scale`` (fp16 grad scalers),
``report`` (start-up lines), ``param_sync`` (``--loco-param-bits``) and
``checkpoint/`` (LoCo state in the distributed optimizer's
checkpoints). Imports the core modules of :mod:`loco_megatron` only; never ``cli`` or
``training`` (docs/architecture.md).
"""
