"""LoCo error buffers in megatron-core's distributed-optimizer checkpoints.

``state`` (the one state shape, ``OptimizerLoCo.state_dict`` / ``load_state_dict``, and the
resume policy), ``torch_format`` (``--ckpt-format torch``: per-rank files), ``dist_format``
(``torch_dist``: sharded entries), ``agree`` (every rank takes one decision per load) and
``hooks`` (the wrappers :func:`loco_megatron.install` applies to megatron-core's calls).
"""
