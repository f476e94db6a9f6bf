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

#: LoCo with tensor parallelism: refused before megatron-core 0.19 (compat.check_loco_tensor_parallel)
requires_loco_tensor_parallel = pytest.mark.skipif(
    compat.megatron_core_version()[:2] < compat.FIRST_WITH_LOCO_TP,
    reason="LoCo with tensor parallelism is refused before megatron-core 0.19 (TP replicas "
           "drift on 0.13.1/0.16.1; docs/compatibility.md)")
