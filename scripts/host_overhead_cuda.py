"""The CUDA backend's Python host time per training step, without a GPU: numba's CUDA
simulator with every kernel launch and cuDNN convolution stubbed to nothing, so what is
timed is the orchestration alone (argument checks, plans, prepared launches, outputs).
A proxy for the eager host time on a GPU (the simulator's arrays differ from numba's),
good for comparing two versions on one machine:

    python scripts/host_overhead_cuda.py TAG                       # this checkout
    PYTHONPATH=/tmp/old python scripts/host_overhead_cuda.py old   # another commit's package
    python scripts/host_overhead_cuda.py TAG evaluate              # acting: evaluate at N = 1

(only the public layer API and `functions.launches` are used).
"""

import argparse
import os
import statistics
import time

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np  # noqa: E402

from conv2d import Conv2d, LayerSpec  # noqa: E402


class NoConvolutions:
    def __init__(self, spec=None):
        pass

    def forward(self, *args, **kwargs):
        pass

    def backward_data(self, *args, **kwargs):
        pass

    def backward_filter(self, *args, **kwargs):
        pass


class NoKernel:
    def __getitem__(self, launch_config):
        return lambda *args: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", nargs="?", default="this", help="the first column of the printed rows")
    ap.add_argument("mode", nargs="?", default="step", choices=["step", "evaluate"],
                    help="a training step (forward + backward_full) or acting (evaluate at N = 1)")
    args = ap.parse_args()
    from numba import cuda

    tag, acting = args.tag, args.mode == "evaluate"
    for norm in ("none", "batch_norm"):
        spec = LayerSpec(batch_size=1, in_height=16, in_width=16, in_channels=3, out_channels=8, kernel=3,
                         padding=1, activation="relu", normalization=norm, dtype="float32")  # tiny_latency
        layer = Conv2d(spec, "cuda", convolutions=NoConvolutions)
        x = cuda.to_device(np.zeros(spec.input_shape, np.float32))
        dy = cuda.to_device(np.zeros(spec.output_shape, np.float32))

        def step():
            if acting:
                layer.evaluate(x)
                return
            layer.forward(x, training=True)
            layer.backward_full(x, dy)
        for _ in range(3):  # every launch prepared (a forward's saved buffers alternate between two sets)
            step()
            layer.evaluate(x)
        for launch in layer.functions.launches.values():
            launch.kernel = NoKernel()
        for _ in range(50):
            step()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(200):
                step()
            times.append((time.perf_counter() - t0) / 200 * 1e6)
        print(f"{tag} | {'evaluate' if acting else 'step'} | {norm} | {statistics.median(times):.1f} |", flush=True)


if __name__ == "__main__":
    main()
