"""conv2d.distributed over gloo with two CPU processes: gradients after the all-reduce
equal one process on the whole batch, parameters equal on every rank after a step, and
two runs give the same bits. (NCCL on several GPUs: not run here.)"""

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra brings it)")

from conv2d import LayerSpec, Sequential  # noqa: E402


def model(seed):
    specs = [LayerSpec(in_height=6, in_width=6, in_channels=2, out_channels=4, kernel=3, padding=1,
                       activation="gelu", dtype="float64"),
             LayerSpec(in_height=6, in_width=6, in_channels=4, out_channels=3, kernel=6, dtype="float64")]
    m = Sequential.from_specs(specs)
    m.init_weights(np.random.default_rng(seed))
    return m


def batch():
    rng = np.random.default_rng(7)
    return rng.standard_normal((4, 6, 6, 2)), rng.standard_normal((4, 1, 1, 3))


def _worker(rank, world, port, out):
    import torch.distributed as dist

    from conv2d.distributed import DataParallel, init
    from conv2d.optim import SGD

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    init("gloo", rank=rank, world_size=world)
    try:
        m = model(seed=rank)  # different weights on purpose: the broadcast makes them equal
        dp = DataParallel(m, average=False)
        dp.broadcast_parameters()
        x, dy = batch()
        part = slice(2 * rank, 2 * rank + 2)
        m.forward(np.ascontiguousarray(x[part]))
        m.backward(np.ascontiguousarray(x[part]), np.ascontiguousarray(dy[part]))
        dp.all_reduce_gradients()
        grads = m.grad_dict()
        SGD(m, lr=0.1).step()
        np.savez(f"{out}.{rank}.npz", **{f"g.{k}": v for k, v in grads.items()},
                 **{f"s.{k}": v for k, v in m.state_dict().items()})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_two(tmp_path, name):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / name)
    mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)
    return [dict(np.load(f"{out}.{r}.npz")) for r in range(2)]


def test_all_reduced_gradients_equal_one_process_on_the_whole_batch_and_repeat_bitwise(tmp_path):
    first, second = run_two(tmp_path, "a"), run_two(tmp_path, "b")
    alone = model(seed=0)
    x, dy = batch()
    alone.forward(x)
    alone.backward(x, dy)
    want = alone.grad_dict()
    for k, v in want.items():
        for rank in range(2):
            np.testing.assert_allclose(first[rank][f"g.{k}"], v, rtol=1e-12, atol=1e-14, err_msg=k)
    for k in first[0]:
        np.testing.assert_array_equal(first[0][k], first[1][k], err_msg=f"{k}: ranks differ")
        np.testing.assert_array_equal(first[0][k], second[0][k], err_msg=f"{k}: runs differ")


def test_the_launcher_trains_the_digits_network_data_parallel(capfd):
    pytest.importorskip("sklearn", reason="scikit-learn (the demo extra) is not installed")
    from conv2d.demos.data_parallel import main

    assert main(["--nproc", "2", "--epochs", "1"]) == 0
    out = capfd.readouterr().out
    assert "rank 0:" in out and "rank 1:" in out and "total: 2 ranks" in out
