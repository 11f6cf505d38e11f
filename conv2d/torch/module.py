"""`Conv2dNormActivation`: the layer as a PyTorch module, a drop-in replacement for
`nn.Sequential(nn.Conv2d, nn.BatchNorm2d or nn.GroupNorm(1, C) or nothing, activation)`
in a channels_last model.

torch owns everything: the parameters are `nn.Parameter`s and the running statistics
buffers, with the Sequential's names ("0.weight", "0.bias", "1.weight", "1.bias",
"1.running_mean", "1.running_var", "1.num_batches_tracked"), so its `state_dict` loads
as it is; the convolution weight is (OC, IC, KH, KW) in channels_last memory, which is
this library's (OC, KH, KW, IC). The backends' functions read them in place: CPU tensors
run on the cpu backend (or the reference, `cpu_backend="reference"`), CUDA tensors on the
CUDA backend (on torch's current stream). In eager mode a call is one autograd node over the backend's functions
(`conv2d.torch.eager`); under `torch.compile` (and for tensor subclasses) it is two custom
ops (`conv2d.torch.ops`: forward, and backward through the same functions) with autograd
between them, so that the compiler sees one opaque op. Both give the same values
bitwise; torch accumulates the gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from conv2d.activations import Activation
from conv2d.backend import Preallocating, check_options, make_functions
from conv2d.backend import get as get_backend
from conv2d.checks import describe
from conv2d.spec import DType, LayerSpec, Normalization, _pair
from conv2d.torch import eager, ops
from conv2d.torch.calls import autocast_dtype, choice_now, host_backend, host_options, refuse_function_transforms
from conv2d.torch.graphs import COUNTS, CallGraphs

_DTYPES = {torch.float64: DType.FLOAT64, torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16,
           torch.bfloat16: DType.BFLOAT16}
_SIXTEEN = (torch.float16, torch.bfloat16)
# A call's (allow_tf32, autotune): Conv2dNormActivation._choice.
CHOICES = tuple((tf32, autotune) for tf32 in (False, True) for autotune in (False, True))
NO_CHOICE = (False, False)
_PLAIN = (torch.Tensor, nn.Parameter)  # not subclasses (DTensor, FakeTensor, ...): those take the ops


class _ConvParameters(nn.Module):
    """The convolution's weight (OC, IC, KH, KW), channels_last, and bias (OC,): nn.Conv2d's names."""

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, int], bias: bool,
                 device: Any, dtype: Any) -> None:
        super().__init__()
        w = torch.empty((out_channels, in_channels, *kernel), device=device, dtype=dtype)
        self.weight = nn.Parameter(w.contiguous(memory_format=torch.channels_last))
        self.bias = nn.Parameter(torch.empty(out_channels, device=device, dtype=dtype)) if bias else None
        fan_in = in_channels * kernel[0] * kernel[1]
        bound = 1.0 / fan_in ** 0.5
        with torch.no_grad():  # nn.Conv2d's default initialisation
            nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)


def _keep_float32(fn: Any) -> Any:
    """`fn` for Module._apply, keeping a norm's tensors float32 when the module moves to a
    16-bit dtype (the type policy keeps norm parameters and statistics in float32, as
    PyTorch's autocast does)."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out.float() if out.dtype in _SIXTEEN else out
    return apply


class _NormParameters(nn.Module):
    """Layer norm's gamma and beta, as nn.GroupNorm(1, C) names them ("weight", "bias"), in
    the compute dtype: float64 in a float64 module, else float32."""

    def __init__(self, channels: int, device: Any, dtype: Any, affine: bool = True) -> None:
        super().__init__()
        dtype = torch.float32 if dtype in _SIXTEEN else dtype
        if affine:
            self.weight = nn.Parameter(torch.ones(channels, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        else:  # nn.GroupNorm(affine=False): no parameters
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def _apply(self, fn: Any, recurse: bool = True) -> "_NormParameters":
        return super()._apply(_keep_float32(fn), recurse)


class _BatchNormParameters(nn.BatchNorm2d):
    """Batch norm's parameters and statistics: an nn.BatchNorm2d (its state_dict, its own
    train/eval flag, `momentum` and `eps` that may be changed after construction, and what
    code that looks for BatchNorm2d layers does to them), kept in float32 in a 16-bit
    module; the module computes with them, this one's forward is never called."""

    def __init__(self, channels: int, eps: float, momentum: float, device: Any, dtype: Any, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        super().__init__(channels, eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats,
                         device=device, dtype=torch.float32 if dtype in _SIXTEEN else dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> "_BatchNormParameters":
        return super()._apply(_keep_float32(fn), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the batch norm of a Conv2dNormActivation holds its parameters; call the module")

    def batch_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers beside the running statistics (made on first use, not in the
        state_dict) that a training call with momentum=None has the layer write the
        batch's statistics into (as a momentum-1 update), for the cumulative average."""
        if getattr(self, "batch_mean", None) is None:  # registered: they move with the module from then on
            self.register_buffer("batch_mean", torch.zeros_like(self.running_mean), persistent=False)
            self.register_buffer("batch_var", torch.ones_like(self.running_var), persistent=False)
        return self.batch_mean, self.batch_var


class Conv2dNormActivation(nn.Module):
    """act(norm(conv(x) + b)) on NCHW-shaped tensors, as the Sequential it replaces.

    x: (N, C, H, W); channels_last memory is read in place (it is NHWC), any other layout
    is copied once to channels_last. y: (N, OC, OH, OW) in channels_last memory.
    `norm`: "batch_norm" (nn.BatchNorm2d), "layer_norm" (nn.GroupNorm(1, OC): one mean and
    variance per sample over C, H, W, affine per channel) or "none". `activation`: a name
    of `conv2d.Activation` ("relu", "gelu", "gelu_tanh", "tanh", "sigmoid", "silu", "relu6",
    "hardswish", "leaky_relu" (with `negative_slope`), "elu" (with `alpha`), "identity", and
    the original library's "fast_tanh", "gelu_original"). `running_var`: "unbiased"
    (PyTorch's BatchNorm2d, the default here) or "biased" (the original library's).
    `layout`: "NCHW" (the default, as above) or "NHWC": x is (N, H, W, C), as this
    library's arrays and JAX's convolutions, read in place when contiguous (else copied
    once), and y is (N, OH, OW, OC), contiguous; the parameters and state_dict are the
    same in both. `cuda_graphs` (on by default; False: every call launches): in eager
    mode on a GPU, replay a CUDA graph of a call whose every address (x, parameters,
    outputs) and flag repeat an earlier call's, in place of the launches
    (conv2d.torch.graphs: the same kernels with the same arguments, so the same bits,
    at a fraction of the host time where a step is host-bound; a training loop that
    keeps no device tensors from step to step repeats its addresses). Not used inside a
    caller's capture (`torch.cuda.graph`: the launches go into it) nor under
    torch.compile. `graph_counts()` says how the calls went.
    Float32 convolutions on CUDA run in TF32 exactly when PyTorch would run its own
    (`torch_uses_tf32`: `torch.backends.cudnn.allow_tf32` or the `fp32_precision`
    settings, read at each call; cuDNN's deterministic plans either way), unless
    `backend_options` gives `allow_tf32`. Likewise the CUDA backend times cuDNN's
    deterministic plans for each new shape and keeps the fastest (`autotune`) exactly
    when `torch.backends.cudnn.benchmark` is on, as PyTorch does for its own, unless
    `backend_options` gives `autotune`.
    `backend_options`: a dict of the CUDA backend's options (e.g. {"allow_tf32": True};
    `conv2d.backend.get("cuda").options` lists them), checked here. `cpu_backend`: "cpu"
    (compiled, `torch.get_num_threads()` threads, the same bits for any count) or
    "reference" (the plain NumPy oracle, to debug against) for CPU tensors.
    `batch_invariant`: LayerSpec's (a sample's bits the same whatever its batch).

    `nn.Conv2d`'s and `nn.BatchNorm2d`'s other arguments are taken by name and run on both
    devices: `momentum=None` (the cumulative average; the batch's statistics go through
    two buffers beside the running ones, not in the state_dict, and the running ones move
    1/num_batches_tracked of the way), `affine=False`, `track_running_stats=False` (batch
    statistics in evaluation too), `dilation`, `groups` (depthwise included), padding
    "same"/"valid" and `padding_mode`. Any other keyword is a TypeError, as in PyTorch.

    Works in eager mode, under torch.compile (any batch size, `dynamic` or not,
    mode="reduce-overhead" included) and torch.export (the exported program runs wherever conv2d is
    installed), and `torch.func.functional_call` (parameters passed in place of the
    module's). A batch of 0 samples gives nn's empty result. Under `torch.autocast` the
    convolution runs in the autocast dtype (x, weight and bias cast, as nn.Conv2d's) and
    y comes back in it, the norm's parameters and statistics in float32. Refused with a message:
    torch.jit.trace/script (use torch.compile or torch.export), torch.func.vmap (batch the
    input instead) and torch.func's grad/jacrev/hessian (use torch.autograd.grad). No
    second derivative: a double backward raises PyTorch's once_differentiable error.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int] = 3,
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
                 dilation: int | tuple[int, int] = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", norm: str = "batch_norm", activation: str = "relu", eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True, track_running_stats: bool = True,
                 running_var: str = "unbiased", device: Any = None, dtype: Any = None, layout: str = "NCHW",
                 cuda_graphs: bool = True, backend_options: dict[str, Any] | None = None,
                 batch_invariant: bool = False, negative_slope: float = 0.01, alpha: float = 1.0,
                 cpu_backend: str = "cpu") -> None:
        super().__init__()
        backend_options = check_options("cuda", backend_options)
        self.cpu_backend = host_backend(cpu_backend)
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout: expected 'NCHW' or 'NHWC', got {layout!r}")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool, got {cuda_graphs!r}")
        self._padding = padding  # as given ("same" stays "same"): for the nn.Conv2d it stands for
        self.layout = layout
        self.cuda_graphs = cuda_graphs
        # A spec validates every argument now; its input size is a placeholder (every
        # call takes any N, H, W: the dilated kernel's extent fits whatever the padding)
        # and its dtype follows the tensors at each call.
        kh, kw = _pair("kernel", kernel_size)
        dh, dw = _pair("dilation", dilation)
        dtype = dtype or torch.get_default_dtype()
        # The spec's dtype is the module's at construction, so that eps is checked where
        # it computes (a float64 module takes eps=1e-300, as nn.BatchNorm2d does).
        self._spec = LayerSpec(batch_size=None, in_height=dh * (kh - 1) + 1, in_width=dw * (kw - 1) + 1,
                               in_channels=in_channels,
                               out_channels=out_channels, kernel=kernel_size, stride=stride, padding=padding,
                               padding_mode=padding_mode,
                               dilation=dilation, groups=groups,
                               activation=activation, normalization=norm, bn_momentum=_layer_momentum(momentum),
                               bn_epsilon=eps,
                               bias=bias, bn_running_var=running_var, dtype=_DTYPES.get(dtype, DType.FLOAT32),
                               bn_affine=affine,
                               bn_track_running_stats=track_running_stats,
                               batch_invariant=batch_invariant, negative_slope=negative_slope,
                               elu_alpha=alpha)
        s = self._spec
        # The least input height and width the dilated kernel fits over the padded input.
        self._least_hw = tuple(d * (k - 1) + 1 - p - q for d, k, p, q in zip(s.dilation, s.kernel, s.padding,
                                                                              s.padding_end))
        self.add_module("0", _ConvParameters(in_channels // s.groups, out_channels, s.kernel, bias, device, dtype))
        if s.normalization is not Normalization.NONE:
            self.add_module("1", _BatchNormParameters(out_channels, eps, momentum, device, dtype, affine,
                                                      track_running_stats)
                            if s.normalization is Normalization.BATCH_NORM else
                            _NormParameters(out_channels, device, dtype, affine))
        self.backend_options = backend_options
        self._functions: dict = {}
        self._views = eager.ParameterViews()
        self._refresh_op_key()

    @property
    def conv(self) -> _ConvParameters:
        return self._modules["0"]

    @property
    def norm(self) -> nn.Module | None:
        return self._modules.get("1")

    @property
    def spec(self) -> LayerSpec:
        """The layer's spec at the module's current dtype (batch and input size unplanned)."""
        return self._spec_for(_DTYPES[self.conv.weight.dtype])

    def _apply(self, fn: Any, recurse: bool = True) -> "Conv2dNormActivation":
        # .to(), .cuda(), .double(), ... give the parameters new memory: drop the views of
        # the old (they would keep it alive until the next call noticed).
        self._views = eager.ParameterViews()
        self.__dict__.pop("_alone", None)  # conv2d.torch.runs.act_alone's run: views of the old memory
        out = super()._apply(fn, recurse)
        self._refresh_op_key()
        return out

    def __getstate__(self) -> dict:
        # copy.deepcopy and pickle: the caches (functions holding cuDNN plans and device
        # memory, views of this module's memory, the kept acting call) stay behind; a copy
        # makes its own on its first call.
        state = {**super().__getstate__(), "_functions": {}, "_views": eager.ParameterViews()}
        state.pop("_alone", None)
        return state

    def extra_repr(self) -> str:
        s = self._spec
        return (f"{s.in_channels}, {s.out_channels}, kernel_size={s.kernel}, stride={s.stride}, "
                f"padding={self._padding!r}, " + (f"padding_mode={s.padding_mode!r}, " if s.padding_mode != "zeros"
                                                  else "")
                + (f"dilation={s.dilation}, " if s.dilation != (1, 1) else "")
                + (f"groups={s.groups}, " if s.groups != 1 else "") + f"bias={s.bias}, norm={s.normalization.value!r}, "
                f"activation={s.activation.value!r}, eps={s.bn_epsilon}, momentum={self._momentum()}, "
                f"running_var={s.bn_running_var.value!r}" + (", layout='NHWC'" if self.layout == "NHWC" else ""))

    def _momentum(self) -> float | None:
        """The batch norm's momentum as nn.BatchNorm2d's (None: the cumulative average)."""
        norm = self.norm
        return norm.momentum if isinstance(norm, nn.BatchNorm2d) else self._spec.bn_momentum

    def _spec_for(self, dtype: DType) -> LayerSpec:
        return dataclasses.replace(self._spec, dtype=dtype)

    def graph_counts(self) -> dict[str, int]:
        """How the module's eager CUDA calls went so far, summed over its devices and
        dtypes: "eager" (launched), "captured", "replayed", "failed" (captures that failed;
        those calls launch)."""
        total = dict.fromkeys(COUNTS, 0)
        for _, graphs in self._functions.values():
            for k, v in (graphs.counts.items() if graphs is not None else ()):
                total[k] += v
        return total

    def _choice(self, x: torch.Tensor) -> tuple[bool, bool]:
        """(allow_tf32, autotune) of this call's convolutions, as PyTorch would choose for its
        own now unless `backend_options` says: TF32 for float32 where `torch_uses_tf32()`, plans
        timed where `torch.backends.cudnn.benchmark` (`calls.choice_now`); (False, False) off
        CUDA, TF32 False for other dtypes. For the eager path: the registered ops make the same
        choice when they run (`ops.key_now`), so a traced call reads none of PyTorch's switches."""
        if not x.is_cuda:
            return NO_CHOICE
        given = self.backend_options
        return choice_now(x.dtype == torch.float32, given.get("allow_tf32"), given.get("autotune"))

    def _options(self, backend: str, choice: tuple[bool, bool]) -> dict[str, Any]:
        if backend != "cuda":
            return host_options(backend)
        return {**self.backend_options, "allow_tf32": choice[0], "autotune": choice[1]}

    def _functions_for(self, x: torch.Tensor, choice: tuple[bool, bool]) -> tuple[Any, Any]:
        """(the backend's functions, their CallGraphs or None) for x's device and dtype, the
        (allow_tf32, autotune) choice and `cpu_backend` (made once each), for the eager path."""
        key = (x.device, x.dtype, choice, None if x.is_cuda else self.cpu_backend)
        found = self._functions.get(key)
        if found is not None:
            return found
        backend = "cuda" if x.is_cuda else self.cpu_backend
        spec = self._spec_for(_DTYPES[x.dtype])
        if backend == "cuda":
            fn, graphs = _cuda_functions(spec, x.device, self._options(backend, choice))
        else:
            fn, graphs = make_functions(backend, spec, **self._options(backend, choice)), None
        op_key = self._op_keys[choice]
        if op_key.startswith("object:"):  # options that are no JSON value: these functions
            ops.register(op_key, fn)
        found = self._functions[key] = (fn, graphs)
        return found

    def _refresh_op_key(self) -> None:
        """The ops' names for the functions of the module's device, dtype and spec, for
        each (allow_tf32, autotune) choice (the ops make them from it), computed here
        rather than in a traced forward: torch.compile cannot trace the JSON it is made
        of without a graph break."""
        w = self.conv.weight
        backend = "cuda" if w.is_cuda else self.cpu_backend
        dtype = _DTYPES.get(w.dtype, DType.FLOAT32)  # another dtype is refused at the call
        spec = self._spec_for(dtype)
        self._op_keys = {choice: ops.key_for(backend, spec, w.device, self._options(backend, choice))
                         for choice in CHOICES}
        # The ops' key: its options leave what backend_options does not give to the
        # choice PyTorch makes when the op runs (ops.FOLLOW).
        given = self.backend_options
        following = host_options(backend) if backend != "cuda" else {
            **given, **{name: given.get(name, ops.FOLLOW) for name in ops.CHOICE_OPTIONS}}
        self._op_key = ops.key_for(backend, spec, w.device, following)
        if self._op_key.startswith("object:"):  # no JSON to make the choices from: name them
            ops.register_choices(self._op_key, dtype is DType.FLOAT32, given.get("allow_tf32"), given.get("autotune"),
                                 self._op_keys)

    def fold_batch_norm(self) -> "Conv2dNormActivation":
        """A new module for inference, in eval mode, on the same device, dtype and layout:
        batch norm's running statistics and affine folded into the convolution's weight
        and bias (`conv2d.fold`, in float64, then cast to the module's dtype), norm
        "none". Its output agrees with this module's eval output within the dtype's
        tolerance, not bitwise. ValueError for a module without batch norm."""
        from conv2d.fold import folded_state
        from conv2d.torch_layout import state_from_torch, weights_to_torch

        spec = dataclasses.replace(self._spec, dtype=DType.FLOAT64,
                                   bn_epsilon=getattr(self.norm, "eps", self._spec.bn_epsilon))
        weight = self.conv.weight
        # The module's state_dict has the Sequential's keys ("0." the conv, "1." the norm).
        state = state_from_torch({k: v.detach().to("cpu", torch.float64) for k, v in self.state_dict().items()},
                                 conv="0", norm="1")
        folded = folded_state(spec, state)  # raises without batch norm
        s = self._spec
        other = Conv2dNormActivation(s.in_channels, s.out_channels, s.kernel, s.stride, self._padding, s.dilation,
                                     s.groups, bias=True, padding_mode=s.padding_mode,
                                     norm="none", activation=s.activation.value, negative_slope=s.negative_slope,
                                     alpha=s.elu_alpha, device=weight.device,
                                     dtype=weight.dtype, layout=self.layout, cuda_graphs=self.cuda_graphs,
                                     backend_options=self.backend_options, batch_invariant=s.batch_invariant,
                                     cpu_backend=self.cpu_backend)
        with torch.no_grad():
            other.conv.weight.copy_(torch.from_numpy(weights_to_torch(folded["weights"])))
            other.conv.bias.copy_(torch.from_numpy(folded["bias"]))
        return other.eval()

    def _follow_norm(self, norm: nn.Module | None) -> bool:
        """Whether the norm (`self.norm`) trains (batch norm: its own flag, as
        nn.BatchNorm2d's, which code that sets BatchNorm2d layers to eval changes), after
        taking in a momentum or eps changed on it since the last call (they are the
        spec's: new functions)."""
        if isinstance(norm, nn.SyncBatchNorm):
            raise NotImplementedError("SyncBatchNorm.convert_sync_batchnorm replaced this module's batch norm: "
                                      "conv2d computes batch statistics per process and does not synchronise "
                                      "them; keep the per-process statistics (convert the model without this "
                                      "module), or use torch.nn.Conv2d + SyncBatchNorm for this layer")
        if not isinstance(norm, nn.BatchNorm2d):
            return self.training
        if (norm.eps, _layer_momentum(norm.momentum)) != (self._spec.bn_epsilon, self._spec.bn_momentum):
            self._spec = dataclasses.replace(self._spec, bn_epsilon=norm.eps,
                                             bn_momentum=_layer_momentum(norm.momentum))
            self._functions = {}
            self._views = eager.ParameterViews()
            self._refresh_op_key()
        return norm.training

    def __prepare_scriptable__(self) -> "Conv2dNormActivation":
        raise TypeError("torch.jit.script: Conv2dNormActivation calls Python functions TorchScript cannot compile; "
                        "use torch.compile, or torch.export for a program to deploy")

    def _check_input(self, x: Any, weight: torch.Tensor) -> None:
        """x's rank, dtype, device (the weight's) and channels, in the module's layout's words."""
        layout = self.layout
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x: expected a 4-D ({', '.join(layout)}) tensor, got {describe(x)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"x: expected a float64, float32, float16 or bfloat16 tensor, got {x.dtype}")
        if x.dtype != weight.dtype or x.device != weight.device:
            raise TypeError(f"x: expected a {weight.dtype} tensor on {weight.device} (the module's), got "
                            f"{x.dtype} on {x.device}")
        c = self._spec.in_channels
        channels = x.shape[1] if layout == "NCHW" else x.shape[3]
        if channels != c:
            want = f"(N, {c}, H, W)" if layout == "NCHW" else f"(N, H, W, {c})"
            raise ValueError(f"x: expected a {layout} tensor of shape {want} ({c} input channels), got {describe(x)}")
        h, w = _height_width(x, layout == "NCHW")
        least = self._least_hw
        if h < least[0] or w < least[1]:
            s = self._spec
            raise ValueError(f"x: expected a {layout} tensor of height >= {max(least[0], 1)} and width >= "
                             f"{max(least[1], 1)} (the kernel {s.kernel}, dilated by {s.dilation}, over the padded "
                             f"input), got {describe(x)}")

    def _eager_call(self, x: torch.Tensor, params: tuple, running_mean: Optional[torch.Tensor],
                    running_var: Optional[torch.Tensor], training: bool, nchw: bool) -> tuple[eager.Call, tuple]:
        """The one place an eager call's tensors become the backend's arguments: its functions (and
        call graphs) for x's device and dtype, the cached NHWC views of the parameters and running
        statistics (holding a host backend's prepared evaluates), the call's flags; with the parameters
        autograd differentiates (the weight's channels_last copy where it is in another memory format)."""
        fn, graphs = self._functions_for(x, self._choice(x))
        weight, bias, gamma, beta = params
        cached = weight.is_contiguous(memory_format=torch.channels_last)
        if cached:
            views, running, ptrs = self._views.get(weight, bias, gamma, beta, running_mean, running_var)
        else:
            # A weight in another memory format: its channels_last copy (one differentiable
            # copy a call), viewed for this call alone (not cached), never replayed.
            weight = weight.contiguous(memory_format=torch.channels_last)
            views, running = eager.parameter_dicts(weight, bias, gamma, beta, running_mean, running_var)
            graphs = ptrs = None
        if graphs is not None and (not self.cuda_graphs or torch.cuda.is_current_stream_capturing()):
            graphs = None  # in a capture of the caller's, the launches go into it (calls.call_context)
        updates = training and self._spec.normalization is Normalization.BATCH_NORM
        prepares = cached and not x.is_cuda and get_backend(fn.name).prepares_evaluate
        call = eager.Call(fn, views, running, training, nchw, self._spec.batch_statistics(training), graphs,
                          ptrs if graphs is not None else (), not updates, self._views if prepares else None)
        return call, (weight, bias, gamma, beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            raise TypeError("torch.jit.trace: Conv2dNormActivation's calls are not traceable into TorchScript; "
                            "use torch.compile, or torch.export for a program to deploy")
        if not torch.is_grad_enabled() and type(x) is torch.Tensor and not x.is_cuda and (
                not torch.compiler.is_compiling()):  # on a GPU the layer's own graphs replay
            from conv2d.torch.runs import act_alone  # runs imports this module

            y = act_alone(self, x)
            if y is not None:
                return y
        conv, norm = self._modules["0"], self._modules.get("1")
        weight = _member(conv, "weight")
        cast = autocast_dtype(x, weight)
        if cast is not None:  # as nn.Conv2d under torch.autocast: the convolution in its dtype
            x, weight = x.to(cast), weight.to(cast)
        self._check_input(x, weight)
        training = self._follow_norm(norm)
        nchw = self.layout == "NCHW"
        if x.shape[0] == 0:
            return self._empty_batch(x, norm, training, nchw)
        if nchw:
            try:
                channels_last = x.is_contiguous(memory_format=torch.channels_last)
            except RuntimeError as e:  # functorch's BatchedTensor: "NYI: querying is_contiguous inside of vmap"
                if "vmap" in str(e):
                    raise NotImplementedError("torch.func.vmap: Conv2dNormActivation takes a batch already (its "
                                              "first dimension); call it on the stacked inputs instead") from e
                raise
            if not channels_last:
                x = x.contiguous(memory_format=torch.channels_last)  # one copy, differentiable
        else:
            x = x.contiguous()  # x itself when contiguous
        bias = _member(conv, "bias")
        if cast is not None and bias is not None:
            bias = bias.to(cast)
        gamma = beta = running_mean = running_var = None
        if norm is not None:
            gamma, beta = _member(norm, "weight"), _member(norm, "bias")
            if self._spec.normalization is Normalization.BATCH_NORM:
                running_mean, running_var = _member(norm, "running_mean"), _member(norm, "running_var")
        cumulative = running_mean is not None and training and norm.momentum is None
        if cumulative:
            # momentum=None: the layer writes the batch's statistics (a momentum-1 update)
            # beside the running ones, which then move 1/(batches so far) of the way there.
            kept = running_mean, running_var
            running_mean, running_var = norm.batch_buffers()
        if type(x) is torch.Tensor and type(weight) in _PLAIN and not torch.compiler.is_compiling():
            refuse_function_transforms(x, weight)
            call, params = self._eager_call(x, (weight, bias, gamma, beta), running_mean, running_var, training, nchw)
            y = eager.run(x, params, running_mean, running_var, call)
        else:
            # torch.compile and tensor subclasses: the registered ops. x and the weight go in
            # in the caller's layout (channels_last memory) and the ops view them as NHWC:
            # a view made in the graph and saved for backward is what reduce-overhead's CUDA
            # graph trees reported overwritten (the weight's, then x's).
            w = weight.contiguous(memory_format=torch.channels_last)
            y = ops.Conv2dFunction.apply(x, w, bias, gamma, beta, running_mean, running_var, training,
                                         self._spec.batch_statistics(training), nchw, self._op_key)
            return eager.count_batch(y, norm, running_mean, training, kept if cumulative else None)
        return eager.count_batch(y.permute(0, 3, 1, 2) if nchw else y, norm, running_mean, training,
                             kept if cumulative else None)

    def _empty_batch(self, x: torch.Tensor, norm: nn.Module | None, training: bool, nchw: bool) -> torch.Tensor:
        """nn's answer to a batch of 0 samples: an empty y of the layout's shape, zero
        gradients for what requires one, the running statistics unchanged and a training
        batch counted (nn.BatchNorm2d counts it too)."""
        _, oh, ow, oc = self._spec.at(1, *_height_width(x, nchw)).output_shape
        y = x.new_zeros((0, oc, oh, ow)).contiguous(memory_format=torch.channels_last) if nchw else x.new_zeros(
            (0, oh, ow, oc))
        live = [t for t in (x, *self.parameters()) if t.requires_grad]
        if torch.is_grad_enabled() and live:
            y = y + sum(t.sum() for t in live) * 0  # an autograd path to each: zero gradients, as nn gives
        if training and isinstance(norm, nn.BatchNorm2d) and norm.track_running_stats:
            _member(norm, "num_batches_tracked").add_(1)
        return y


def _member(module: nn.Module, name: str) -> Any:
    """`getattr(module, name)` for a parameter or buffer, read from nn.Module's own dicts
    where it is there: nn.Module.__getattr__ cost ~0.7 us a lookup (on the CPU machine),
    and a call reads up to six. Anything else (a parametrization's property,
    torch.nn.utils.parametrize, whose parameter leaves the dict) through getattr. The one
    place the module reads nn.Module's private `_parameters` and `_buffers`."""
    params = module._parameters
    if name in params:
        return params[name]
    buffers = module._buffers
    if name in buffers:
        return buffers[name]
    return getattr(module, name)


def _height_width(x: torch.Tensor, nchw: bool) -> tuple[int, int]:
    """x's (H, W) in the module's layout: (N, C, H, W) or (N, H, W, C)."""
    return (x.shape[2], x.shape[3]) if nchw else (x.shape[1], x.shape[2])


def _layer_momentum(momentum: float | None) -> float:
    """The LayerSpec's momentum for nn.BatchNorm2d's: None (the cumulative average, which
    the module computes from a momentum-1 update, see `eager.count_batch`) is 1."""
    return 1.0 if momentum is None else momentum


@torch.compiler.disable
def _cuda_functions(spec: LayerSpec, device: torch.device, options: dict) -> tuple[Any, Any]:
    """(the CUDA backend's functions for `spec` on `device`, their CallGraphs or None).
    Outside torch.compile's tracing: the functions compile numba kernels, and numba's
    compiler reads NumPy's ufuncs, which dynamo swaps for its own while it traces
    (KeyError: <ufunc 'multiply'> when a compiled module made them first, on the H200)."""
    with torch.cuda.device(device):
        fn = make_functions("cuda", spec, **options)
    if not isinstance(fn, Preallocating):  # the eager node writes into tensors it allocated
        raise TypeError(f"the cuda backend's functions ({type(fn).__name__}) lack conv2d.backend.Preallocating's "
                        f"saved_out/y_out/grads_out/d_x_out")
    # A backend given a stream of its own runs there, not on torch's current stream
    # where a graph would replay.
    return fn, (None if fn.stream_given else CallGraphs(fn, device))


def activation_module(name: str | Activation, parameter: float | None = None) -> nn.Module:
    """PyTorch's module for an activation that PyTorch has (for building the Sequential
    this module replaces), with LeakyReLU's negative_slope or ELU's alpha (`parameter`,
    PyTorch's default when None); ValueError for the original library's own two."""
    act = Activation(name)
    given = {} if parameter is None else {"negative_slope": parameter} if act is Activation.LEAKY_RELU else {
        "alpha": parameter}
    table = {Activation.IDENTITY: nn.Identity, Activation.RELU: nn.ReLU, Activation.TANH: nn.Tanh,
             Activation.SIGMOID: nn.Sigmoid, Activation.GELU: nn.GELU,
             Activation.GELU_TANH: lambda: nn.GELU(approximate="tanh"), Activation.SILU: nn.SiLU,
             Activation.RELU6: nn.ReLU6, Activation.HARDSWISH: nn.Hardswish,
             Activation.LEAKY_RELU: lambda: nn.LeakyReLU(**given), Activation.ELU: lambda: nn.ELU(**given)}
    if act not in table:
        raise ValueError(f"activation: PyTorch has no {act.value!r} (the original library's own)")
    return table[act]()


def reference_sequential(module: Conv2dNormActivation) -> nn.Sequential:
    """The plain PyTorch Sequential that `module` replaces, with the same parameters (a copy)
    and state_dict keys (nn.BatchNorm2d has only the unbiased running-variance rule)."""
    s = module._spec
    w = module.conv.weight
    conv = nn.Conv2d(s.in_channels, s.out_channels, s.kernel, s.stride, module._padding, dilation=s.dilation,
                     groups=s.groups, bias=s.bias, padding_mode=s.padding_mode, device=w.device, dtype=w.dtype)
    layers: list[nn.Module] = [conv]
    if module.norm is not None:
        norm_dtype = torch.float32 if w.dtype in _SIXTEEN else w.dtype
        where = dict(device=w.device, dtype=norm_dtype, affine=s.bn_affine)
        layers.append(nn.BatchNorm2d(s.out_channels, eps=s.bn_epsilon, momentum=module._momentum(),
                                     track_running_stats=s.bn_track_running_stats, **where)
                      if s.normalization is Normalization.BATCH_NORM else nn.GroupNorm(1, s.out_channels,
                                                                                        eps=s.bn_epsilon, **where))
    layers.append(activation_module(s.activation, s.activation_parameter))
    seq = nn.Sequential(*layers)
    seq.load_state_dict(module.state_dict())
    return seq
