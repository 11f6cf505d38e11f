"""The digits demo's network trained data-parallel over CPU processes (gloo) with
`conv2d.distributed`: `python -m conv2d.demos.data_parallel --nproc 2` prints per-rank and
total throughput and each rank's held-out accuracy."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from conv2d.distributed import DataParallel, init


def _worker(rank: int, world: int, port: int, epochs: int, batch: int) -> None:
    import torch.distributed as dist

    from conv2d.demos.common import softmax_cross_entropy
    from conv2d.demos.digits import load_data, network
    from conv2d.optim import Adam

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    init("gloo", rank=rank, world_size=world)
    try:
        x_train, y_train, x_test, y_test = load_data(0, "float32")
        model = network(batch, "float32", "reference")
        model.init_weights(np.random.default_rng(rank))  # different on purpose: the broadcast makes them equal
        dp = DataParallel(model)
        dp.broadcast_parameters()
        opt = Adam(model, lr=3e-3)
        rng = np.random.default_rng(1)  # the same order on every rank; each takes its slice
        steps, start = 0, time.perf_counter()
        for _ in range(epochs):
            order = rng.permutation(len(y_train))
            for i in range(0, len(order) - batch * world + 1, batch * world):
                idx = order[i + rank * batch:i + (rank + 1) * batch]
                x = np.ascontiguousarray(x_train[idx])
                logits = model.forward(x).reshape(batch, -1).astype(np.float64)
                _, d_logits = softmax_cross_entropy(logits, y_train[idx])
                opt.zero_grad()
                model.backward(x, d_logits.reshape(batch, 1, 1, -1).astype(np.float32))
                dp.all_reduce_gradients()
                opt.step()
                steps += 1
        elapsed = time.perf_counter() - start
        logits = model.evaluate(x_test).reshape(len(y_test), -1)
        acc = float((logits.argmax(axis=1) == y_test).mean())
        print(f"rank {rank}: {steps} steps of {batch} images in {elapsed:.2f} s, {steps * batch / elapsed:.0f} "
              f"images/s, held-out accuracy {acc:.4f} (its own batch-norm running statistics)", flush=True)
        dist.barrier()
        if rank == 0:
            print(f"total: {world} ranks, {world * steps * batch / elapsed:.0f} images/s", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conv2d.demos.data_parallel",
                                 description="train the digits network data-parallel over CPU processes (gloo)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = ap.parse_args(argv)
    if args.nproc < 1 or args.epochs < 1 or args.batch_size < 1:
        ap.error("--nproc, --epochs and --batch-size: expected ints >= 1")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.nproc, port, args.epochs, args.batch_size), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
