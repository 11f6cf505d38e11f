"""conv2d: a 2-D convolution layer (NHWC) with bias, optional norm and an activation, with a
NumPy reference backend and a CUDA backend behind one API."""

from conv2d.activations import Activation
from conv2d.backend import register_backend
from conv2d.io import load, save
from conv2d.layer import Conv2d
from conv2d.sequential import Sequential
from conv2d.spec import DType, LayerSpec, Normalization, RunningVariance

__all__ = ["Activation", "Conv2d", "DType", "LayerSpec", "Normalization", "RunningVariance", "Sequential", "load",
           "register_backend", "save"]
__version__ = "0.1.0"
