"""The NumPy reference backend: readable, exact in float64, the oracle for the GPU path."""

from conv2d.reference.backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
