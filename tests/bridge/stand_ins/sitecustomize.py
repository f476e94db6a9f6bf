"""Test environment only: activates Megatron-Bridge's stand-ins (bridge_stand_ins.py) in every
interpreter started with tests/bridge/stand_ins first on PYTHONPATH (the test ranks, the
documented example run by tests/bridge/test_docs_example.py)."""

import bridge_stand_ins

bridge_stand_ins.activate()
