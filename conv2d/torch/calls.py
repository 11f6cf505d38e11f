"""What both of the module's autograd paths use (the eager node, conv2d.torch.eager, and the
registered ops, conv2d.torch.ops): detached parameter dicts, the CUDA functions' saved
outputs as torch tensors, the call context (CUDA capture, CPU threads), the first-order-only
backward, and the choice of TF32 and plan timing that follows PyTorch's switches."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from conv2d.spec import Normalization


class _SecondDerivative(torch.autograd.Function):
    """The gradients a first-order backward returned, passed through; differentiating them
    raises, as PyTorch's once_differentiable does."""

    @staticmethod
    def forward(ctx: Any, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple:
        raise RuntimeError("trying to differentiate twice a function that was marked with @once_differentiable: "
                           "conv2d.torch.Conv2dNormActivation has no second derivative (a gradient penalty or a "
                           "meta-gradient through it needs torch.nn.Conv2d there)")


def first_order_only(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """Decorate an autograd Function's backward: run it without building a graph, and when
    autograd was asked for one (create_graph=True) and the function's inputs require grad,
    return gradients whose own backward raises (torch's once_differentiable only does so
    when the incoming gradients require grad: for d(loss)/dx of a sum they do not, and the
    second derivative through the saved x and weights came back silently zero)."""
    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Tensor) -> tuple:
        if not torch.is_grad_enabled():  # autograd's backward without create_graph: no graph to guard
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        sources = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, Tensor) and t.requires_grad]
        if not sources:
            return outputs
        tensors = [o for o in outputs if isinstance(o, Tensor)]
        guarded = iter(_SecondDerivative.apply(len(tensors), *tensors, *sources))
        return tuple(next(guarded) if isinstance(o, Tensor) else o for o in outputs)
    return wrapper


# Looked up once: the call is on every eager call's path (None where torch lacks it).
_FUNCTORCH_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def refuse_function_transforms(*tensors: Optional[Tensor]) -> None:
    """NotImplementedError, naming what works instead, for tensors of a torch.func transform
    (grad, jacrev, hessian, ...): the module's calls run outside autograd's dispatcher, on
    the tensors' memory, which a transform's wrappers do not have. The one place the
    module asks functorch (a private torch API) whether a tensor is wrapped."""
    wrapped = _FUNCTORCH_WRAPPED
    if wrapped is not None and any(t is not None and wrapped(t) for t in tensors):
        raise NotImplementedError("torch.func transforms (grad, jacrev, hessian, vmap): Conv2dNormActivation runs "
                                  "outside autograd's dispatcher and takes no transform's tensors; use "
                                  "torch.autograd.grad or loss.backward() on its outputs (torch.func.functional_call "
                                  "with replaced parameters works)")


def autocast_dtype(x: Any, weight: Tensor) -> Any:
    """The dtype `torch.autocast` runs a convolution in on x's device where it is on and
    casts it (floating-point x and weight, not yet both of that dtype), else None. The
    norm's parameters and statistics stay float32, as the type policy keeps them for 16-bit
    layers and autocast keeps batch norm's."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if x.dtype == dtype and weight.dtype == dtype or torch.float64 in (x.dtype, weight.dtype):
        return None  # autocast leaves float64 as it is
    return dtype


def torch_uses_tf32() -> bool:
    """Whether PyTorch runs its own float32 cuDNN convolutions in TF32 now. Where the
    installed torch has the `fp32_precision` settings: the first of
    `torch.backends.cudnn.conv`'s, `torch.backends.cudnn`'s and `torch.backends`' that is
    not "none" ("tf32": yes, "ieee": no; all "none": no, as the legacy
    `allow_tf32 = False` leaves them). Else the legacy `torch.backends.cudnn.allow_tf32`
    (which newer torch refuses to read once the two APIs were mixed)."""
    cudnn = torch.backends.cudnn
    conv = getattr(cudnn, "conv", None)
    if conv is None or not hasattr(conv, "fp32_precision"):
        return bool(cudnn.allow_tf32)
    for holder in (conv, cudnn, torch.backends):
        precision = getattr(holder, "fp32_precision", "none")
        if precision != "none":
            return precision == "tf32"
    return False


def choice_now(float32: bool, allow_tf32: Optional[bool] = None,
               autotune: Optional[bool] = None) -> tuple[bool, bool]:
    """(allow_tf32, autotune) of a CUDA call's convolutions now: each as given, or where
    None as PyTorch would choose for its own cuDNN convolutions now (TF32 where
    `torch_uses_tf32()`, plans timed where `torch.backends.cudnn.benchmark`); TF32 only
    for float32."""
    tf32 = float32 and (torch_uses_tf32() if allow_tf32 is None else bool(allow_tf32))
    return tf32, bool(torch.backends.cudnn.benchmark) if autotune is None else bool(autotune)


def host_backend(name: Any) -> str:
    """The module's `cpu_backend` after checking it: a registered backend that runs on the
    host (no stream, no copy of a host input to a device): "cpu" (the default) or
    "reference" (the plain oracle, to debug against)."""
    from conv2d import backend

    declared = backend.get(name) if isinstance(name, str) and name in backend.backend_names() else None
    if declared is None or declared.has_stream or declared.copies_host_input:
        hosts = [n for n in backend.backend_names() if not (backend.get(n).has_stream or backend.get(n).copies_host_input)]
        raise ValueError(f"cpu_backend: expected one of {hosts} (the backends that run CPU tensors), got {name!r}")
    return name


def host_options(name: str) -> dict[str, Any]:
    """The options the module makes a host backend's functions with: the cpu backend
    runs as many threads as torch's intra-op pool (`torch.get_num_threads()` at each
    call: conv2d.cpu.threads); the reference takes none."""
    from conv2d import backend

    return {"threads": "torch"} if "threads" in backend.get(name).options else {}


def call_context(fn: Any, x: Tensor) -> contextlib.AbstractContextManager:
    """What a backend call on x runs under. While torch's current stream is captured into
    a CUDA graph (torch.cuda.graph, or torch.compile's CUDA graphs), the CUDA functions'
    calls defer numba's frees (a free would invalidate the capture). On the CPU, a backend
    that sets its own thread counts (the cpu backend's `threads`) is left to; under any
    other, NumPy's BLAS is first set to one thread for the process (`one_blas_thread`).
    Otherwise nothing."""
    if not x.is_cuda:
        if getattr(fn, "threads", None) is None:
            one_blas_thread()
        return contextlib.nullcontext()
    if torch.cuda.is_current_stream_capturing():
        return fn.deferred_frees()
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def one_blas_thread() -> None:
    """Set NumPy's BLAS to one thread, once, for the process (threadpoolctl): the module's
    first CPU call does, since torch's own intra-op threads take the cores. With both
    pools at the cores' count each slows the other: the digits CNN's training step took
    10.3 ms with the module (PyTorch's own 1.1 ms) and 2.4 ms with one BLAS thread or one
    torch thread (2 cores; a one-off timing of scripts/bench_networks.py's models, each side
    alone). Limiting per call and restoring after did not help (10.9 ms): the restored
    pool's threads compete again. `threadpoolctl.threadpool_limits` sets it back for a
    caller who wants to."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


@contextlib.contextmanager
def keeping_nothing(fn: Any, x: Tensor) -> Iterator[None]:
    """For the registered ops: after the call, the CUDA functions keep none of the
    tensors they were handed or made (`Functions.release_all`). Under torch.compile's
    CUDA graph trees every live tensor in the graphs' memory pool must be an output of
    the graph; a kept one fails the recording ("tensor(s) in the cudagraph pool not
    tracked as outputs")."""
    try:
        yield
    finally:
        if x.is_cuda:
            fn.release_all()


def detached(*tensors: Optional[Tensor]) -> list:
    return [t if t is None else t.detach() for t in tensors]


def norm_groups(fn: Any, n: int) -> int:
    norm = fn.spec.normalization
    return {Normalization.BATCH_NORM: fn.spec.out_channels, Normalization.LAYER_NORM: n}.get(norm, 0)


def saved_outputs(fn: Any, x: Tensor, placeholders: bool = True) -> dict[str, Optional[Tensor]]:
    """New tensors for the CUDA functions' saved values of a forward on x (N, H, W, C):
    "pre" (N, OH, OW, OC) in x's dtype, "mean" and "inv_std" float32 per norm group;
    without a norm (nothing reads or writes them) one-element `placeholders` (an
    operator's outputs are tensors), or None."""
    shape = fn.spec.at(*x.shape[:3]).output_shape
    groups = norm_groups(fn, x.shape[0])
    out = {"pre": torch.empty(shape, dtype=x.dtype, device=x.device), "mean": None, "inv_std": None}
    if groups or placeholders:
        out["mean"], out["inv_std"] = (torch.empty(max(groups, 1), dtype=torch.float32, device=x.device)
                                       for _ in range(2))
    return out


def param_dict(weight: Tensor, bias: Optional[Tensor], gamma: Optional[Tensor], beta: Optional[Tensor]) -> dict:
    params = {"weights": weight}
    if bias is not None:
        params["bias"] = bias
    if gamma is not None:
        params["gamma"], params["beta"] = gamma, beta
    return params
