"""The NumPy reference backend: readable, exact in float64, the oracle for the GPU path.

`conv.py` and `norm.py` hold the pieces; `functional.py` the layer's forward and backward
over explicit arrays, and `Functions`, what `Conv2d(spec, backend="reference")` runs on."""

from conv2d.reference.functional import Functions, Saved, backward, forward

__all__ = ["Functions", "Saved", "backward", "forward"]
