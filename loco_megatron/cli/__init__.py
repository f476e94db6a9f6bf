"""Command line and configuration: the ``--loco-*`` flags (``flags``, derived from the settings
registry on :class:`loco_megatron.LoCoConfig`), YAML ``--config`` files (``yaml_config``),
preflight checks run before ranks start (``preflight``, ``schedule``), one-line error exits
(``console``) and the ``loco-megatron`` command (``command``: planner, config check).
Imports the core and the megatron-core seam; never ``training`` (docs/architecture.md).
"""
