"""Where the module's eager host time goes with and without CUDA graph replays
(cuda_graphs=True / False), beside PyTorch's Sequential: us a call, best of three runs of
--n calls, one process, on the GPU.

    python3 scripts/probe_graphs.py --shape tiny_latency --bn [--dtype bfloat16] [--n 300]

Rows: each model's step (forward + backward, x requiring grad), also with autograd's
backward on the calling thread (torch.autograd.set_multithreading_enabled(False); by
default a CUDA backward runs on autograd's device thread), our forward with and without
grad, the replay() of one captured forward and backward graph alone (drained: its GPU
time where that is longer; and the host's share only), Functions.follow, four
torch.empty, and an empty Python autograd node's step (the floor of any Python node) on
both threads. Every row but "host only" drains the GPU inside its timing: a row is the
host's time a call only where the GPU keeps up."""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny_latency")
    ap.add_argument("--bn", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--n", type=int, default=600, help="calls a run (best of three runs)")
    a = ap.parse_args()
    import torch
    from bench_cuda import our_module, torch_nchw, torch_sequential
    from bench_shapes import bench_spec, inputs
    from probe_cuda import host_us
    from probe_module import _EngineProbe

    spec = bench_spec(a.shape, a.bn, a.dtype)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = True, False
    xh, dyh = inputs(spec)
    x, dy = torch_nchw(xh, spec).requires_grad_(True), torch_nchw(dyh, spec)

    def timed(f, n=a.n) -> float:
        """us a call, the GPU drained inside the timing (a piece whose GPU work outlasts
        its host time reads as GPU time; probe_cuda.host_us stops the clock before)."""
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return min(runs)

    out = {}
    for name, model in (("torch", torch_sequential(spec).train()), ("graphs", our_module(spec, cuda_graphs=True)),
                        ("launched", our_module(spec, cuda_graphs=False))):
        def step():
            x.grad = None
            model(x).backward(dy)

        def forward():
            model(x)
        out[f"{name} step"] = timed(step)
        if name == "torch":
            torch.autograd.set_multithreading_enabled(False)
            out[f"{name} step, autograd on this thread"] = timed(step)
            torch.autograd.set_multithreading_enabled(True)
            continue
        out[f"{name} forward"] = timed(forward)
        with torch.no_grad():
            out[f"{name} forward no_grad"] = timed(forward)
        torch.autograd.set_multithreading_enabled(False)
        out[f"{name} step, autograd on this thread"] = timed(step)
        torch.autograd.set_multithreading_enabled(True)
        if name == "graphs":
            (fn, call_graphs), = model._functions.values()
            entries = list(call_graphs._graphs.items())
            for direction, is_forward in (("forward", True), ("backward", False)):
                found = [entry[0] for key, entry in entries if key[0] == is_forward]
                if found:
                    out[f"{direction} graph replay()"] = timed(found[-1].replay)
                    # 50: few enough that the GPU queue never fills and holds the host back
                    out[f"{direction} graph replay(), host only"] = host_us(found[-1].replay, torch.cuda.synchronize,
                                                                            n=50)
            x_nhwc = x.detach().permute(0, 2, 3, 1)
            out["fn.follow(x)"] = timed(lambda: fn.follow(x_nhwc))
            out["torch.empty x4"] = timed(lambda: [torch.empty(16, device="cuda") for _ in range(4)])
            print(f"graphs kept: {len(entries)}, calls: {model.graph_counts()}", flush=True)

    empty = _EngineProbe(x)  # an identity node whose backward does nothing
    out["empty Python node step (x-shaped)"] = timed(lambda: empty.run(lambda: None))
    torch.autograd.set_multithreading_enabled(False)
    out["empty Python node step, autograd on this thread"] = timed(lambda: empty.run(lambda: None))
    torch.autograd.set_multithreading_enabled(True)
    print(f"== {a.shape} bn={a.bn} {a.dtype}, host us a call")
    for k, v in out.items():
        print(f"  {k:42s} {v:8.1f}")


if __name__ == "__main__":
    main()
