"""The fast kernel set: the steps of simple.py fused where fusion pays, each kernel named
for the reference steps it computes (reference function -> simple kernels -> here):

| reference step | simple.py | fast kernel |
| --- | --- | --- |
| _statistics, batch norm: statistics + inverse_std + update_running | statistics, inverse_std, update_running | `batch_norm_statistics` |
| _statistics, layer norm | statistics, inverse_std | `layer_norm_partials` + `layer_norm_statistics` |
| _statistics, batch norm outside training | inverse_std | `running_statistics` |
| _activation_input + activations.forward | activation_input, activation_forward | `normalise_and_activate` |
| param_backward + gradient_means (norm) | param_backward, gradient_means | `norm_gradients` (+ `layer_norm_gradient_partials` + `partials_final` for layer norm) |
| activation_backward + norm backward + to_storage + bias_backward | activation_backward, backward_*_statistics, to_storage, bias_backward | `grad_pre_activations` |
| accumulated weight gradient | (accumulate) | `accumulate_stored` |
| evaluate: pre-activations + norm + activation, small N | (the steps above) | `direct_evaluate` |

Every array is flat and C-ordered: activations are (M, C) with M = N*OH*OW rows and
C = OC channels (NHWC), a sample is S = OH*OW*OC consecutive values. Storage arrays are
float32, float16, or uint16 holding bfloat16 bits. The row engine sums in float64 and, for
float32 storage, computes each value in float64 (rows.value_math); the rest is float32.

The four per-value kernels are one row engine (`rows.py`) compiled for four jobs; its
reductions, and the segment reductions of layer norm here, run in a fixed order, so
results are bitwise identical run to run: phase one gives each block a fixed slice and
sums it in a fixed order into one partial per (block, group); phase two adds those
partials in a fixed order (and, for layer norm's per-sample sums, a fixed tree). The
partition depends only on the shape, the storage format and the launch settings
(config.LaunchConfig).

`kernel_set(storage, activation, norm, lanes, wide, config)` compiles (once) the kernels
for one layer kind; the storage format, activation, norm, lane layout and launch
settings are compile-time constants of its closures.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from conv2d.activations import Activation
from conv2d.cuda.kernels.activation import ONE, ZERO
from conv2d.cuda.kernels.bits import storage_io
from conv2d.cuda.kernels.config import DEFAULT_CONFIG, SEG_THREADS, WARP, LaunchConfig
from conv2d.cuda.kernels.layout import nhwc_position, window_sum_function
from conv2d.cuda.kernels.rows import (GRAD_PRE_ACTIVATIONS, NORM_BATCH, NORM_GRADIENTS, NORM_MODE,
                                      NORMALISE_AND_ACTIVATE, STATISTICS, fold_rows_function, row_kernels,
                                      value_math)
from conv2d.cuda.runtime import numba_cuda
from conv2d.spec import Normalization

cuda = numba_cuda()


@dataclass(frozen=True)
class KernelSet:
    """The compiled fast kernels of one layer kind (see the module docstring's table).
    The row-engine kernels take the same arguments (rows.py's `rows`); what a job does
    not read or write is a one-element dummy."""

    batch_norm_statistics: object  # row engine, STATISTICS
    normalise_and_activate: object  # row engine, NORMALISE_AND_ACTIVATE
    norm_gradients: object  # row engine, NORM_GRADIENTS
    grad_pre_activations: object  # row engine, GRAD_PRE_ACTIVATIONS
    layer_norm_partials: object  # per-sample partial shifted sums of z
    layer_norm_gradient_partials: object  # per-sample partial sums of d_a * gamma and of it times x_hat
    partials_final: object  # phase two of a segment reduction: the totals
    layer_norm_statistics: object  # phase two of layer norm's statistics: mean, inv_std
    running_statistics: object  # batch norm outside training: mean, inv_std of the running ones
    accumulate_stored: object  # grad += new, elementwise, both in the storage format
    direct_evaluate: object  # evaluate in one kernel (no norm, batch norm): conv, norm, activation


@functools.lru_cache(maxsize=None)
def kernel_set(storage: str, activation: Activation, normalization: Normalization, lanes: int = 1,
               wide: bool = False, config: LaunchConfig = DEFAULT_CONFIG, parameter: float | None = None) -> KernelSet:
    """The kernels of one layer kind. Row-engine threads keep `lanes` consecutive channels
    (1, or config.lanes_for); with `wide` they read them with one 8-byte load (the arrays
    they read must then be 8-byte aligned), without it one load a value: the same sums in
    the same order, so the two give bitwise identical results. `parameter`: the
    activation's (LayerSpec.activation_parameter)."""
    rows = row_kernels(storage, activation, normalization, lanes, wide, config, parameter)
    segments = _segment_kernels(storage, activation, normalization, parameter)
    return KernelSet(rows[STATISTICS], rows[NORMALISE_AND_ACTIVATE], rows[NORM_GRADIENTS],
                     rows[GRAD_PRE_ACTIVATIONS], segments["partials"][STATISTICS],
                     segments["partials"][NORM_GRADIENTS], segments["partials_final"], segments["statistics"],
                     *_elementwise_kernels(storage, activation, normalization, parameter))


@functools.lru_cache(maxsize=None)
def _segment_kernels(storage: str, activation: Activation, normalization: Normalization,
                     parameter: float | None) -> dict:
    """Layer norm's per-sample reductions: partial sums over fixed slices of a sample,
    then one warp a sample adds them (the statistics, or the gradient terms' totals)."""
    load = storage_io(storage).load
    per_value = value_math(storage, activation, normalization, parameter)
    stored_activation_input, act_d = per_value.stored_activation_input, per_value.act_d
    fold_rows = fold_rows_function()

    @cuda.jit(device=True, inline=True)
    def warp_sums(p0, p1, P, G, s0, s1):
        # The totals of both partial arrays for the block's group g, by one warp: a
        # strided sum per lane, then the tree.
        g = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        a0, a1 = ZERO, ZERO
        for p in range(lane, P, WARP):
            a0 += p0[p * G + g]
            a1 += p1[p * G + g]
        s0[lane] = a0
        s1[lane] = a1
        cuda.syncthreads()
        fold_rows(s0, s1, lane, WARP, 1)
        return s0[0], s1[0]

    @cuda.jit
    def partials_final(p0, p1, P, G, sums):
        """Phase two of both reductions: grid G blocks of one warp; partials are (P, G);
        sums[g] and sums[G + g] receive the two totals of group g."""
        s0 = cuda.shared.array(WARP, dtype=np.float32)
        s1 = cuda.shared.array(WARP, dtype=np.float32)
        t0, t1 = warp_sums(p0, p1, P, G, s0, s1)
        if cuda.threadIdx.x == 0:
            g = cuda.blockIdx.x
            sums[g] = t0
            sums[G + g] = t1

    @cuda.jit(device=True, inline=True)
    def sample_terms(job, z, d_y, i, c, g, S, mean, inv_std, gamma, beta):
        # Per sample: statistics shifted by the sample's first value; gradient terms
        # d_a * gamma and that times x_hat.
        if job == STATISTICS:
            v = load(z, i) - load(z, g * S)
            return v, v * v
        a, x_hat = stored_activation_input(z, i, c, g, mean, inv_std, gamma, beta)
        d_a_gamma = load(d_y, i) * act_d(a) * gamma[c]
        return d_a_gamma, np.float32(d_a_gamma * x_hat)

    def make_partials(job):
        @cuda.jit
        def segment_partials(z, d_y, mean, inv_std, gamma, beta, C, S, out0, out1):
            """Per-sample partial sums over a fixed slice of its S values: grid (N, Q),
            block SEG_THREADS; out0/out1 are (Q, N)."""
            s0 = cuda.shared.array(SEG_THREADS, dtype=np.float32)
            s1 = cuda.shared.array(SEG_THREADS, dtype=np.float32)
            n = cuda.blockIdx.x
            q = cuda.blockIdx.y
            t = cuda.threadIdx.x
            a0, a1 = ZERO, ZERO
            for j in range(q * SEG_THREADS + t, S, cuda.gridDim.y * SEG_THREADS):
                i = n * S + j
                v0, v1 = sample_terms(job, z, d_y, i, j % C, n, S, mean, inv_std, gamma, beta)
                a0 += v0
                a1 += v1
            s0[t] = a0
            s1[t] = a1
            cuda.syncthreads()
            fold_rows(s0, s1, t, SEG_THREADS, 1)
            if t == 0:
                out0[q * cuda.gridDim.x + n] = s0[0]
                out1[q * cuda.gridDim.x + n] = s1[0]
        return segment_partials

    @cuda.jit
    def layer_norm_statistics(p0, p1, P, G, z, S, count, epsilon, mean, inv_std):
        """Phase two of layer norm's statistics (one warp per sample g): the shifted
        totals t0 = sum(z - shift), t1 = sum((z - shift)^2), shift = the sample's first
        value, give mean and inv_std."""
        s0 = cuda.shared.array(WARP, dtype=np.float32)
        s1 = cuda.shared.array(WARP, dtype=np.float32)
        t0, t1 = warp_sums(p0, p1, P, G, s0, s1)
        if cuda.threadIdx.x == 0:
            g = cuda.blockIdx.x
            shift = load(z, g * S)
            shifted_mean = t0 / count
            var = max(t1 / count - shifted_mean * shifted_mean, ZERO)
            mean[g] = shift + shifted_mean
            inv_std[g] = ONE / math.sqrt(var + epsilon)

    return {"partials": {job: make_partials(job) for job in (STATISTICS, NORM_GRADIENTS)},
            "partials_final": partials_final, "statistics": layer_norm_statistics}


@functools.lru_cache(maxsize=None)
def _elementwise_kernels(storage: str, activation: Activation, normalization: Normalization,
                         parameter: float | None) -> tuple:
    """(running_statistics, accumulate_stored, direct_evaluate): one thread a value."""
    io = storage_io(storage)
    load, store, encode = io.load, io.store, io.encode
    per_value = value_math(storage, activation, normalization, parameter)
    activation_input, act_f = per_value.activation_input, per_value.act_f
    norm = NORM_MODE[normalization]
    window_sum = window_sum_function(storage)

    @cuda.jit
    def running_statistics(running_mean, running_var, epsilon, mean, inv_std):
        """Batch norm outside training: mean = running_mean, inv_std = 1/sqrt(running_var + eps)."""
        c = cuda.grid(1)
        if c < mean.size:
            mean[c] = running_mean[c]
            inv_std[c] = ONE / math.sqrt(running_var[c] + epsilon)

    @cuda.jit
    def accumulate_stored(grad, new, total):
        """grad += new, both in the storage format (the sum is rounded once, in float32)."""
        for i in range(cuda.grid(1), total, cuda.gridsize(1)):
            store(grad, i, load(grad, i) + load(new, i))

    @cuda.jit
    def direct_evaluate(x, w, b, has_bias, running_mean, running_var, epsilon, gamma, beta, y, H, W, C, OH, OW,
                        OC, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG):
        """evaluate (no norm, or batch norm with the running statistics) in one launch, for
        small inputs where cuDNN's execute and three launches cost more than the math:
        one thread an output value sums conv(x, w) directly (kh, kw, then channels, in
        order) and adds the bias, rounds the sum as the pre-activations are stored, then
        normalises and applies the activation as normalise_and_activate does. x (N, H, W,
        C), w (OC, KH, KW, CG), y (N, OH, OW, OC), flat; taps DH, DW apart; output channel
        oc reads the CG input channels of its group, oc // OCG (OCG = OC / groups)."""
        for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
            n, oh, ow, oc = nhwc_position(i, OH, OW, OC)
            acc = window_sum(x, w, n, oh, ow, oc, H, W, C, KH, KW, SH, SW, PH, PW, DH, DW, CG, OCG)
            if has_bias:
                acc += load(b, oc)
            _, z = encode(acc)
            if norm == NORM_BATCH:
                a, _ = activation_input(z, running_mean[oc], ONE / math.sqrt(running_var[oc] + epsilon), gamma[oc],
                                        beta[oc])
            else:
                a = z
            store(y, i, act_f(a))

    return running_statistics, accumulate_stored, direct_evaluate
