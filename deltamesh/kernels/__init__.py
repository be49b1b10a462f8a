"""GDN, conv1d, paged-attention, norm and activation kernels behind one registry (see deltamesh.kernels.registry).
Importing the GPU backends only registers them; their libraries are imported when a CUDA engine asks."""

from deltamesh.kernels import fla_backend, flashinfer_backend, triton_backend  # noqa: F401  (register)
from deltamesh.kernels.registry import Kernels, ModelShapes, select_kernels

__all__ = ["Kernels", "ModelShapes", "select_kernels"]
