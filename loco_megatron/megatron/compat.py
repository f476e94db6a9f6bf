"""Version adapter: every megatron-core name the plugin touches, found in one place.

Supported: megatron-core 0.19.x (Python 3.12, with ``megatron.training``). Older releases
(0.13-0.16) are the subject of a later compatibility leg; their differences go here.
"""

import importlib

from megatron.core import package_info


def megatron_core_version() -> tuple:
    """``(major, minor, patch)`` of the installed megatron-core."""
    return tuple(int(x) for x in package_info.__version__.split(".")[:3] if x.isdigit())


def param_and_grad_buffer_module():
    """``megatron.core.distributed.param_and_grad_buffer`` (holds ``dist_reduce_scatter_func``)."""
    return importlib.import_module("megatron.core.distributed.param_and_grad_buffer")


def bucket_group_class():
    """``_ParamAndGradBucketGroup``, whose ``start_grad_sync`` launches the bucket reduce."""
    return param_and_grad_buffer_module()._ParamAndGradBucketGroup


def ddp_class():
    """megatron-core's ``DistributedDataParallel``."""
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel
