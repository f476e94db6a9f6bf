"""Shared skip markers for the compatibility legs (docs/compatibility.md)."""

import pytest

from loco_megatron.megatron import compat

#: tests that run megatron.training (the main job, its workarounds): absent from the
#: megatron-core wheels before 0.17, i.e. on the Python 3.11 legs (0.13.x, 0.16.1)
requires_megatron_training = pytest.mark.skipif(
    not compat.has_megatron_training(),
    reason=f"megatron.training is absent from megatron-core wheels before 0.17 (installed: "
           f"{'.'.join(map(str, compat.megatron_core_version()))}); these tests need 0.19.x "
           f"(bash install.sh) or a Megatron-LM checkout")
