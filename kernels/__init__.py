"""GDN, conv1d and paged-attention kernels behind one registry (see kernels.registry)."""

from kernels.registry import Kernels, ModelShapes, select_kernels

__all__ = ["Kernels", "ModelShapes", "select_kernels"]
