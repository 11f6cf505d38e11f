"""The CUDA backend: cuDNN convolutions (conv2d/cuda/cudnn.py), numba kernels for the norm,
activations and bias gradient (conv2d/cuda/kernels/), device memory and streams
(conv2d/cuda/runtime.py), tied together by `Functions` (conv2d/cuda/functional.py).

Nothing is imported here, so `import conv2d.cuda` never touches the GPU stack; use
`Conv2d(spec, backend="cuda")`."""
