"""The fast CPU backend: NumPy and BLAS for the dense convolutions, numba's CPU compiler
for depthwise convolutions and the fused norm and activation passes; deterministic for
any thread count. `Conv2d(spec, backend="cpu")`; the reference (conv2d.reference) is what
it is checked against."""
