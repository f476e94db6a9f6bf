"""CPU stand-in for CUDA (tests and CPU runs only; never active on a GPU).

docs/architecture.md (CPU emulation of CUDA)."""

from .cpu_cuda import activate, activate_if_no_gpu, deactivate, is_active

__all__ = ["activate", "activate_if_no_gpu", "deactivate", "is_active"]
