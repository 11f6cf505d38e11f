"""What the pieces of an eager CUDA step cost, each beside what it replaced, and what
cuDNN offers for fusion. Host times are per call (perf_counter over many calls, the
stream drained before and after); GPU times are CUDA events around repeated calls.

    python scripts/probe_cuda.py [--shapes tiny_latency,rl_small] [--dtypes float32,bfloat16]

1. a numba kernel through numba's dispatcher vs a prepared `Launch` (and that the two
   write bitwise the same output);
2. one cuDNN execute through the frontend's public `execute` vs a prepared `Execution`;
3. an output array from numba's `device_array` vs the layer's `OutputAllocator`;
4. GPU time of each convolution with cuDNN's heuristic plan vs the autotuned one;
5. whether cuDNN builds conv + bias with the pre-activations kept and a ReLU, and conv +
   bias + statistics (genstats), for the fusions issue 4 asked to evaluate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import SHAPES, bench_spec, inputs  # noqa: E402


def host_us(fn, sync, n: int = 2000) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    sync()
    return dt


def gpu_ms(cuda, stream, fn, n: int = 10) -> float:
    fn()
    rounds = []
    for _ in range(3):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        for _ in range(n):
            fn()
        end.record(stream)
        end.synchronize()
        rounds.append(cuda.event_elapsed_time(start, end) / n)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()

    from conv2d import Conv2d
    from conv2d.cuda import cudnn, kernels as K
    from conv2d.cuda.launch import Launch, device_pointer
    from conv2d.cuda.memory import OutputAllocator
    from conv2d.cuda.runtime import to_device_bits

    spec = bench_spec("tiny_latency", True, "float32")
    layer = Conv2d(spec, "cuda")
    impl = layer.functions
    plan = next(iter(impl._plans.values()))  # the planned batch's shape
    cuda, stream, sync = impl.cuda, impl.stream, impl.stream.synchronize

    # 1. kernel launch
    rng = np.random.default_rng(0)
    total, c = plan.total, plan.C
    z = cuda.to_device(rng.standard_normal(total).astype(np.float32))
    y1, y2 = cuda.device_array(total, np.float32), cuda.device_array(total, np.float32)
    stats = [cuda.to_device(rng.random(c).astype(np.float32) + 0.5) for _ in range(4)]
    d = impl._dummy
    counter = cuda.to_device(np.zeros(1 + impl.config.phase_groups(plan.P), np.int32))
    kernel = impl.k.rows[K.WRITE_Y]

    def kernel_args(out):
        return dict(z=z, d_y=z, out=out, mean=stats[0], inv_std=stats[1], gamma=stats[2], beta=stats[3], sums=d,
                    batch_stats=False, count=np.float32(1), epsilon=np.float32(0), momentum=np.float32(0),
                    var_scale=np.float32(1), M=plan.M, C=c, S=plan.S, out0=plan.col[0], out1=plan.col[1],
                    counter=counter, acc0=d, acc1=d, accumulate=K.ACC_NONE)
    launch = Launch(kernel, plan.P, K.ROW_THREADS, stream, kernel_args(y2))
    print(f"1. launch: numba dispatcher "
          f"{host_us(lambda: kernel[plan.P, K.ROW_THREADS, stream](*kernel_args(y1).values()), sync):.1f} us, "
          f"prepared Launch {host_us(launch, sync):.1f} us (driver path: {launch.prepared}); bitwise equal: "
          f"{bool((y1.copy_to_host() == y2.copy_to_host()).all())}", flush=True)

    # 2. cuDNN execute
    conv = plan.conv
    execution = conv._executions["forward"]
    g = execution.graph
    x_dev = cuda.to_device(rng.standard_normal(spec.input_shape).astype(np.float32))
    out = cuda.device_array(spec.output_shape, np.float32)
    arrays = {"x": x_dev, "w": layer._params["weights"], "b": layer._params["bias"], "y": out}
    pack = {g.tensors[r]: device_pointer(a) for r, a in arrays.items()}
    ws = conv.workspace_ptr
    public = host_us(lambda: g.graph.execute(pack, ws, handle=conv.handle), sync)
    for role, a in arrays.items():
        execution.set(role, device_pointer(a))
    print(f"2. cuDNN execute: frontend execute(dict) {public:.1f} us, prepared Execution "
          f"{host_us(execution.run, sync):.1f} us (native entry point: {execution.native})", flush=True)

    # 3. output allocation
    shape = (64, 32, 32, 32)
    allocator = OutputAllocator(cuda, stream)
    print(f"3. output array: numba device_array "
          f"{host_us(lambda: cuda.device_array(shape, np.float32, stream=stream), sync):.1f} us, "
          f"OutputAllocator {host_us(lambda: allocator.array(shape, np.float32), sync):.1f} us", flush=True)

    # 4. heuristic vs autotuned plans
    print("4. convolution GPU ms, heuristic plan -> autotuned plan")
    for name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            spec = bench_spec(name, False, dtype)
            x_host, dy_host = inputs(spec)
            bufs = {"x": cuda.to_device(to_device_bits(x_host), stream=stream),
                    "dy": cuda.to_device(to_device_bits(dy_host), stream=stream)}
            cells = []
            for op in ("forward", "backward_data", "backward_filter"):
                times = []
                for tuned in (False, True):
                    layer = Conv2d(spec, "cuda", autotune=tuned)
                    p = layer._params
                    dev = layer.functions.dev_dt
                    dx = cuda.device_array(spec.input_shape, dev)
                    dw = cuda.device_array(int(np.prod(spec.weight_shape)), dev)
                    y = cuda.device_array(spec.output_shape, dev)
                    c2 = next(iter(layer.functions._plans.values())).conv
                    run = {"forward": lambda: c2.forward(bufs["x"], p["weights"], p["bias"], y),
                           "backward_data": lambda: c2.backward_data(bufs["dy"], p["weights"], dx),
                           "backward_filter": lambda: c2.backward_filter(bufs["x"], bufs["dy"], dw)}[op]
                    times.append((gpu_ms(cuda, layer.functions.stream, run), c2.plans[op]))
                cells.append(f"{op} {times[0][0]:.4f} [{times[0][1]}] -> {times[1][0]:.4f} [{times[1][1]}]")
            print(f"   {name} {dtype}: " + "; ".join(cells), flush=True)

    # 5. fusion support
    import cudnn as fe
    for dtype in ("float32", "bfloat16"):
        spec = bench_spec("resnet_56", True, dtype)
        dt = {"float32": fe.data_type.FLOAT, "bfloat16": fe.data_type.BFLOAT16}[dtype]
        dims = cudnn._dims(spec)
        for what in ("conv+bias keeping z, then ReLU", "conv+bias keeping z, then genstats"):
            try:
                gg = fe.pygraph(io_data_type=dt, intermediate_data_type=fe.data_type.FLOAT,
                                compute_data_type=fe.data_type.FLOAT, handle=conv.handle)
                t = {r: gg.tensor(name=r, dim=dims[r][0], stride=dims[r][1], data_type=dt) for r in ("x", "w", "b")}
                zz = gg.bias(input=gg.conv_fprop(image=t["x"], weight=t["w"], padding=[1, 1], stride=[1, 1],
                                                 dilation=[1, 1]), bias=t["b"])
                zz.set_output(True).set_data_type(dt)
                if "ReLU" in what:
                    gg.relu(input=zz).set_output(True).set_data_type(dt)
                else:
                    for s in gg.genstats(input=zz):
                        s.set_output(True).set_data_type(fe.data_type.FLOAT)
                gg.validate()
                gg.build_operation_graph()
                gg.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
                gg.deselect_numeric_notes([fe.numerical_note.NONDETERMINISTIC])
                gg.check_support()
                gg.build_plans()
                print(f"5. {what}, {dtype}: builds ({gg.get_plan_name_at_index(0)})", flush=True)
            except Exception as e:
                print(f"5. {what}, {dtype}: not supported ({type(e).__name__}: {str(e)[:120]})", flush=True)


if __name__ == "__main__":
    main()
