"""Every script in scripts/ still starts: its --help runs (imports, argument parsing), and
the scripts with a CPU mode run it on a small case, so a script cannot rot unnoticed while
the library under it changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Programs (a __main__ block); scripts/bench_shapes.py is the benchmark scripts' shared module.
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_there_are_scripts_to_check():
    assert SCRIPTS


def run_script(script: Path, *args: str, timeout: int = 120, returncode: int = 0,
               **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_vars)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == returncode, done.stderr[-2000:]
    return done


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_prints_its_help(script):
    done = run_script(script, "--help")
    assert "usage" in done.stdout.lower(), done.stdout[:500]


def test_the_reference_benchmark_runs_on_the_cpu_and_says_where_its_table_comes_from():
    pytest.importorskip("torch")
    pytest.importorskip("threadpoolctl")
    out = run_script(ROOT / "scripts" / "bench_reference.py", "--shapes", "tiny_latency", "--dtypes", "float32",
                     "--repeats", "1", timeout=300).stdout
    assert "| tiny_latency | bn | float32 |" in out
    assert "Made by `python3 scripts/bench_reference.py --shapes tiny_latency" in out and "commit " in out


def test_the_host_overhead_script_runs_in_the_simulator():
    out = run_script(ROOT / "scripts" / "host_overhead_cuda.py", "this", timeout=300).stdout
    assert "this | step | batch_norm |" in out


def test_the_fusion_probe_reports_the_rows_a_dead_process_did_not_measure():
    """Each fusion runs in a process of its own; one that dies (here: no GPU visible, on a
    GPU machine too) leaves a row per case saying so, and the probe goes on to the next
    fusion."""
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "cudnn_fusions.py", "--fusions", "conv_genstats,dgrad_drelu", "--dtypes",
                     "float32", "--iters", "1", timeout=300, CUDA_VISIBLE_DEVICES="").stdout
    for fusion in ("conv_genstats", "dgrad_drelu"):
        assert f"| {fusion} | impala 32->32 3x3 | float32 | process died (exit 1) |" in out


def test_the_networks_benchmark_runs_on_the_cpu_with_the_module_swapped_in(tmp_path):
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "bench_networks.py", "--device", "cpu", "--networks", "nature_dqn",
                     "--precisions", "strict", "--modes", "eager", "--rounds", "1", "--iters", "1",
                     "--train-batch", "2", "--rows", "train,act", "--out", str(tmp_path / "tables"),
                     timeout=300).stdout
    assert "| nature_dqn | train | strict | eager |" in out and "| nature_dqn | act | strict | eager |" in out
    assert "failed" not in out
    table = (tmp_path / "tables" / "bench_networks_cpu.md").read_text()
    assert "Made by `python3 scripts/bench_networks.py" in table and "Unfinished" not in table


def test_a_networks_benchmark_stopped_midway_leaves_its_finished_rows_marked_unfinished(monkeypatch, tmp_path):
    """A run stopped by a time limit (on the GPU machine, `timeout` kills it) keeps the rows
    it made: the table is written after every row, marked unfinished until the run ends."""
    pytest.importorskip("torch")
    import bench_networks

    _run_stopped_at_its_second_row(bench_networks, monkeypatch, tmp_path)
    table = (tmp_path / "bench_networks_cpu.md").read_text()
    assert "Unfinished: the run was stopped after the rows below." in table
    assert "| nature_dqn | train | strict | eager | 1 | 1.000 | 2.000 | 0.50 |" in table
    assert "| nature_dqn | act |" not in table
    assert bench_networks.GRAPHS_HEADING in table and GRAPH_LINE in table  # the row's call graphs, under the table


GRAPH_ROUNDS = [{"eager": 1, "captured": 1, "replayed": 8, "failed": 0}]  # what the stub says of our call graphs
GRAPH_LINE = "- `nature_dqn train strict eager 1`: " + str(GRAPH_ROUNDS)


def _stopped_after_one_row(bench_networks, monkeypatch, tmp_path, *more):
    """A CPU run of nature_dqn's train and act rows (compare stubbed) stopped at its second
    row, its table in tmp_path; returns the rows the stub was asked for."""
    asked = []

    def compare(name, precision, mode, row, args, threads="all"):
        asked.append(row)
        if len(asked) == 2 and not more:
            raise KeyboardInterrupt
        times = {"ours": (1.0, 1.0), "torch": (4.0, 4.0) if row == "act" else (2.0, 2.0)}
        return times if row == "act" else {**times, "graphs": GRAPH_ROUNDS}
    monkeypatch.setattr(bench_networks, "compare", compare)
    monkeypatch.setattr(sys, "argv", ["bench_networks.py", "--device", "cpu", "--networks", "nature_dqn",
                                      "--precisions", "strict", "--modes", "eager", "--threads", "1",
                                      "--rows", "train,act", "--out", str(tmp_path), *more])
    return asked


def _run_stopped_at_its_second_row(bench_networks, monkeypatch, tmp_path, commit=None):
    """The run of _stopped_after_one_row (at `commit`, as the GPU machine's runs name theirs)."""
    if commit:
        monkeypatch.setenv("CONV2D_COMMIT", commit)
    with pytest.raises(KeyboardInterrupt):
        _stopped_after_one_row(bench_networks, monkeypatch, tmp_path)
        bench_networks.main()


def test_a_resumed_networks_benchmark_runs_only_the_rows_its_table_lacks(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    import bench_networks

    _run_stopped_at_its_second_row(bench_networks, monkeypatch, tmp_path, commit="abc1234")
    asked = _stopped_after_one_row(bench_networks, monkeypatch, tmp_path, "--resume")
    bench_networks.main()
    assert asked == ["act"]
    table = (tmp_path / "bench_networks_cpu.md").read_text()
    assert "Unfinished" not in table and "commit abc1234" in table
    train = table.index("| nature_dqn | train | strict | eager | 1 | 1.000 | 2.000 | 0.50 |")
    assert train < table.index("| nature_dqn | act | strict | eager | 1 | 1.000 | 4.000 | 0.25 |")
    assert table.count(GRAPH_LINE) == 1  # the resumed row's call graphs kept


def test_a_networks_benchmark_refuses_to_resume_a_table_of_another_commit(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    import bench_networks

    _run_stopped_at_its_second_row(bench_networks, monkeypatch, tmp_path, commit="abc1234")
    monkeypatch.setenv("CONV2D_COMMIT", "def5678")
    asked = _stopped_after_one_row(bench_networks, monkeypatch, tmp_path, "--resume")
    with pytest.raises(SystemExit, match="was made by another run \\(commit abc1234;.*expected one of this one: "
                                         "commit def5678;"):
        bench_networks.main()
    assert asked == []


def test_a_networks_benchmark_refuses_to_resume_without_a_table_folder():
    pytest.importorskip("torch")
    done = run_script(ROOT / "scripts" / "bench_networks.py", "--device", "cpu", "--resume", returncode=2)
    assert "|" not in done.stdout and "--resume: expected --out DIR" in done.stderr


def test_a_networks_benchmark_refuses_to_resume_a_table_of_other_columns(monkeypatch, tmp_path):
    """A table made without --rest has no room for its columns: resuming it with --rest is refused."""
    pytest.importorskip("torch")
    import bench_networks

    _run_stopped_at_its_second_row(bench_networks, monkeypatch, tmp_path, commit="abc1234")
    asked = _stopped_after_one_row(bench_networks, monkeypatch, tmp_path, "--resume", "--rest")
    with pytest.raises(SystemExit, match="table has other columns; expected .*ours without its layers wall ms"):
        bench_networks.main()
    assert asked == []


def test_the_network_layers_script_times_each_swapped_layer_of_the_digits_cnn_on_the_cpu():
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "network_layers.py", "--device", "cpu", "--network", "digits_cnn",
                     "--rounds", "1", "--iters", "2", timeout=300).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(":")[0] for r in rows] == ["| 0", "| 1", "| 2"]  # the digits CNN's three convolutions
    assert "| all layers |" in out and "| ours / PyTorch |" in out


def test_the_cpu_convolutions_script_times_each_digits_convolution_three_ways_and_writes_its_table(tmp_path):
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "bench_cpu_convolutions.py", "--networks", "digits_cnn,mobilenet_v2",
                     "--rounds", "1", "--iters", "1", "--out", str(tmp_path), timeout=300).stdout
    digits = [line for line in out.splitlines() if line.startswith("| digits_cnn |")]
    assert [r.split(" | ")[1] for r in digits] == ["1->16 3x3/1", "16->32 3x3/2", "32->10 4x4/1"]
    assert all(r.split(" | ")[6] != "-" for r in digits)  # dense: a product timed
    depthwise = [line for line in out.splitlines() if " groups " in line]
    assert depthwise and all(r.split(" | ")[6] == "-" for r in depthwise)  # a compiled loop, no product
    assert "| **digits_cnn** | all |" in out and "| **mobilenet_v2** | all |" in out
    assert "Made by `python3 scripts/bench_cpu_convolutions.py" in (tmp_path / "bench_cpu_convolutions.md").read_text()


def test_the_module_host_cost_script_times_both_rows_and_profiles_ours_on_the_cpu():
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "module_host_cost.py", "--device", "cpu", "--bn", "--calls", "20", "--top",
                     "30", timeout=300).stdout
    assert "| act |" in out and "| train |" in out
    assert "Ours, act: own time per call by function" in out and "Ours, train: own time per call by function" in out
    # the module's own forward is among the profiled functions (the 30 largest: the ranking
    # of the small ones moves from run to run)
    assert "torch/module.py:forward" in out
    assert "| row | module alone us | empty node us | PyTorch us |" in out  # stubbed backend, empty node


def test_the_networks_benchmark_writes_a_network_without_our_layers_as_a_third_side():
    """--rest: eager acting rows gain the columns of a third side (our network without our
    layers) and its share of PyTorch's time. The values are the side's own; nothing is
    asserted about which side is faster (timings move under CI's load)."""
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "bench_networks.py", "--device", "cpu", "--networks", "nature_dqn",
                     "--precisions", "strict", "--modes", "eager", "--threads", "1", "--rounds", "1", "--iters",
                     "3", "--rows", "act", "--rest", timeout=300).stdout
    assert "| ours without its layers wall ms | / torch wall |" in out
    row = next(line for line in out.splitlines() if line.startswith("| nature_dqn | act |"))
    ours, torch_ms, _, rest, share = (float(c) for c in row.strip(" |").split("|")[5:10])
    assert min(ours, torch_ms, rest) > 0 and share == pytest.approx(rest / torch_ms, abs=0.01)


def test_a_network_without_our_layers_calls_them_once_and_then_replays_their_outputs():
    """bench_networks.without_layers: each swapped module (the Nature-DQN's run of three
    layers) stands behind a LayerOutput that calls it once and then returns its output,
    so the timed calls run only the network's other parts (the linear head); the outputs
    are ours."""
    torch = pytest.importorskip("torch")
    import copy

    import bench_networks

    _, ours = bench_networks.models("nature_dqn", "cpu", torch.float32)
    ours.eval()
    rest = bench_networks.without_layers(copy.deepcopy(ours))
    stand_ins = [m for m in rest.modules() if isinstance(m, bench_networks.LayerOutput)]
    assert stand_ins and not [m for m in rest.modules() if type(m).__name__ == "Conv2dRun"
                              and not any(m is s.module for s in stand_ins)]
    calls = []
    for s in stand_ins:
        s.module.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 4, 84, 84).to(memory_format=torch.channels_last)
    with torch.no_grad():
        want = ours(x)
        first, again = rest(x), rest(x)
    assert len(calls) == len(stand_ins)  # the first call only
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_the_networks_benchmark_refuses_pytorch_determinism_off_cuda():
    """--torch-deterministic is PyTorch's cuDNN setting: on the CPU the script says so and
    times nothing, instead of printing a table without the side it was asked for."""
    pytest.importorskip("torch")
    done = run_script(ROOT / "scripts" / "bench_networks.py", "--device", "cpu", "--torch-deterministic",
                      returncode=2)
    assert "|" not in done.stdout
    assert "--torch-deterministic" in done.stderr and "expected --device cuda, got --device cpu" in done.stderr


def test_a_network_comparison_that_fails_says_whose_side_failed(monkeypatch):
    """A CUDA error is reported at the next synchronisation, whoever caused it: each side's
    warm-up ends with one, so that a failure is PyTorch's or ours, not the row's."""
    torch = pytest.importorskip("torch")
    import bench_networks

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("an illegal memory access was encountered")
    real = bench_networks.models
    monkeypatch.setattr(bench_networks, "models", lambda *a, **kw: (Broken(), real(*a, **kw)[1]))
    args = bench_networks.argparse.Namespace(device="cpu", train_batch=2, rounds=1, iters=1, torch_deterministic=False,
                                             no_runs=False, rest=False)
    with pytest.raises(bench_networks.SideFailed) as failed:
        bench_networks.compare("digits_cnn", "strict", "eager", "act", args)
    assert (failed.value.side, failed.value.phase) == ("torch", "warm-up")
    assert bench_networks.failure(failed.value) == ("failed (PyTorch's side, warm-up: RuntimeError: an illegal memory "
                                                    "access was encountered)")


def test_a_network_comparison_that_fails_in_its_timed_runs_says_whose_runs_failed(monkeypatch):
    """The sides take turns in the timed rounds, each ending with a synchronisation: an
    error there is the side's whose runs raised (here ours, after its warm-up passed)."""
    torch = pytest.importorskip("torch")
    import bench_networks

    theirs, ours = bench_networks.models("digits_cnn", "cpu", torch.float32)
    calls = []
    real_forward = ours.forward

    def failing_after_warm_up(x):
        calls.append(1)
        if len(calls) > 3:  # the warm-up's three calls pass
            raise RuntimeError("an illegal memory access was encountered")
        return real_forward(x)
    ours.forward = failing_after_warm_up
    monkeypatch.setattr(bench_networks, "models", lambda *a, **kw: (theirs, ours))
    args = bench_networks.argparse.Namespace(device="cpu", train_batch=2, rounds=1, iters=1, torch_deterministic=False,
                                             no_runs=False, rest=False)
    with pytest.raises(bench_networks.SideFailed) as failed:
        bench_networks.compare("digits_cnn", "strict", "eager", "act", args)
    assert (failed.value.side, failed.value.phase) == ("ours", "timed runs")
    assert bench_networks.failure(failed.value).startswith("failed (our side, timed runs: RuntimeError: an illegal")


def test_a_network_comparison_prints_our_call_graphs_round_by_round(monkeypatch, capsys):
    """Where our modules count call graphs (on CUDA), each row is followed by what each
    timed round did with them: a round that captured or launched again was timed so."""
    torch = pytest.importorskip("torch")
    import bench_networks

    class Counted(torch.nn.Module):  # a stand-in for a module with call graphs: each call replays
        def __init__(self):
            super().__init__()
            self.counts = {"eager": 0, "captured": 0, "replayed": 0, "failed": 0}

        def forward(self, x):
            self.counts["replayed"] += 1
            return x

        def graph_counts(self):
            return dict(self.counts)
    ours = torch.nn.Sequential(torch.nn.Sequential(Counted()), Counted())
    monkeypatch.setattr(bench_networks, "models", lambda *a, **kw: (torch.nn.Identity(), ours))
    args = bench_networks.argparse.Namespace(device="cpu", train_batch=2, rounds=2, iters=3, torch_deterministic=False,
                                             no_runs=False, rest=False)
    bench_networks.compare("digits_cnn", "strict", "eager", "act", args)
    round_ = {"eager": 0, "captured": 0, "replayed": 6, "failed": 0}  # 3 calls of 2 modules a round
    assert f"# digits_cnn act strict eager: our call graphs, round by round: {[round_, round_]}" in \
        capsys.readouterr().out


def test_after_a_cuda_error_the_networks_benchmark_runs_each_later_row_in_a_process_of_its_own(monkeypatch, capsys):
    """A CUDA error leaves the process's context unusable: the failing row says so, and
    the rows after it run in processes of their own (run_alone), not in the poisoned one."""
    pytest.importorskip("torch")
    import bench_networks

    class AcceleratorError(RuntimeError):  # torch's class name for CUDA errors
        pass
    ran_here, ran_alone = [], []

    def compare(name, precision, mode, row, args, threads="all"):
        ran_here.append(row)
        raise bench_networks.SideFailed("ours", "timed runs") from AcceleratorError(
            "CUDA error: an illegal memory access was encountered")

    def run_alone(args, name, precision, mode, row, threads="all"):
        ran_alone.append(row)
        return {"times": {"ours": [2.0, 2.0], "torch": [1.0, 1.0]}}
    monkeypatch.setattr(bench_networks, "compare", compare)
    monkeypatch.setattr(bench_networks, "run_alone", run_alone)
    monkeypatch.setattr(sys, "argv", ["bench_networks.py", "--device", "cpu", "--networks", "digits_cnn",
                                      "--precisions", "strict,bfloat16", "--modes", "eager", "--rows", "train,act",
                                      "--threads", "1"])
    bench_networks.main()
    out = capsys.readouterr().out
    assert ran_here == ["train"] and ran_alone == ["train", "act", "act"]
    assert "| digits_cnn | train | strict | eager | 1 | failed (our side, timed runs: AcceleratorError: CUDA error" in out
    assert "| digits_cnn | act | bfloat16 | eager | 1 | 2.000 | 1.000 | 2.00 |" in out


def test_a_row_run_alone_reports_what_its_process_measured_or_how_it_ended():
    """bench_networks.py --one (what run_alone starts): one comparison's times as JSON; a
    process that ends without them is a failed cell with its exit status."""
    pytest.importorskip("torch")
    import bench_networks

    args = bench_networks.argparse.Namespace(device="cpu", rounds=1, iters=1, loop_warmup=10, loop_steps=5,
                                             train_batch=2, torch_deterministic=False, no_runs=False, rest=False)
    said = bench_networks.run_alone(args, "digits_cnn", "strict", "eager", "act")
    assert set(said) == {"times"} and set(said["times"]) == {"ours", "torch"}
    said = bench_networks.run_alone(args, "no_such_network", "strict", "eager", "act")
    assert said["failed"].startswith("failed (its own process ended, exit 2: ")


def test_the_networks_benchmark_times_the_dqn_loop_of_each_variant_on_the_cpu():
    pytest.importorskip("torch")
    pytest.importorskip("minatar", reason="MinAtar (extra breakout) is not installed")
    out = run_script(ROOT / "scripts" / "bench_networks.py", "--device", "cpu", "--rows", "loop", "--rounds", "1",
                     "--loop-warmup", "40", "--loop-steps", "20", timeout=300).stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"torch", "module", "demo"} <= set(rows) and "torch graph" not in rows  # no CUDA graphs on the CPU
    assert rows["torch"].rstrip().endswith("| 1.00 |")


def test_the_accuracy_script_runs_on_the_cpu_stage_by_stage():
    pytest.importorskip("torch")
    out = run_script(ROOT / "scripts" / "accuracy_cuda.py", "--device", "cpu", "--shapes", "tiny_latency",
                     timeout=300).stdout
    for stage in ("conv forward", "conv backward-data", "conv backward-filter", "batch norm forward (y)",
                  "batch norm backward (d_z)", "gamma gradient", "beta gradient", "bias gradient (sum of d_z)"):
        assert f"| tiny_latency | {stage} |" in out


def test_with_its_own_relu_decisions_float32_is_rounding_away_from_float64():
    """accuracy_cuda.network_errors(same_decisions=True): each side against float64 that
    takes that side's ReLU decisions, so that the error is the arithmetic's alone (plain
    float64 flips ReLUs whose input is within rounding of 0: whole terms of a gradient)."""
    pytest.importorskip("torch")
    from accuracy_cuda import network_errors

    errors = network_errors("nature_dqn", "float32", "cpu", same_decisions=True)
    assert set(errors) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "7.weight", "7.bias",
                           "9.weight", "9.bias"}
    assert all(ours < 1e-5 and theirs < 1e-5 for ours, theirs in errors.values()), errors


def test_a_decided_relu_passes_the_gradient_where_its_mask_says_not_where_x_is_positive():
    torch = pytest.importorskip("torch")
    from accuracy_cuda import DecidedReLU

    x = torch.tensor([-1e-9, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    y = DecidedReLU(torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64))(x)
    y.sum().backward()
    assert y.tolist() == [-1e-9, 0.0, 3.0] and x.grad.tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("slices", ["0", "1"], ids=["xdist_workers", "fixed_slices"])
def test_the_gpu_test_runner_counts_passes_and_failures_and_fails_on_a_failure(slices, tmp_path):
    # scripts/gpu_tests.sh, as the GPU machine runs it (there: 16 xdist workers), on a
    # file of three passing tests and one failing one.
    tests = tmp_path / "test_sample.py"
    tests.write_text("import pytest\n\n@pytest.mark.parametrize('i', range(3))\ndef test_passes(i):\n    pass\n\n"
                     "def test_fails():\n    assert False\n")
    env = dict(os.environ, TESTS=tests.name, LOGS=str(tmp_path / "logs"), SLICES=slices, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_tests.sh"), "2"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)  # test ids are relative to the folder run in
    summary = [line for line in done.stdout.splitlines() if line.startswith("gpu_tests:")]
    assert done.returncode != 0 and summary, done.stdout[-2000:] + done.stderr[-2000:]
    assert "4 collected" in summary[0] and "3 passed, 1 failed" in summary[0], summary


@pytest.mark.parametrize("variant, forward, weights", [("strip", "strip", "fast"), ("value", "value", "simple")])
def test_the_breakdown_scripts_depthwise_variants_build_the_kernels_they_name(variant, forward, weights):
    """scripts/breakdown_cuda.py --depthwise-variants: the numba depthwise kernels as the
    backend picks them (strips along the width), or one value a thread; the factories'
    choices restored after."""
    import importlib.util
    import math

    from numba import cuda

    from conv2d.cuda.depthwise import DepthwiseConvolutions
    from conv2d.cuda.launch import Launcher
    from conv2d.cuda.plans import convolution_spec
    from conv2d.spec import LayerSpec

    found = importlib.util.spec_from_file_location("breakdown_cuda", ROOT / "scripts" / "breakdown_cuda.py")
    breakdown = importlib.util.module_from_spec(found)
    found.loader.exec_module(breakdown)
    spec = convolution_spec(LayerSpec(batch_size=2, in_height=6, in_width=8, in_channels=4, out_channels=4, kernel=3,
                                      padding=1, groups=4, dtype="float32"))
    stream = cuda.stream()

    def built():
        conv = DepthwiseConvolutions(cuda, spec, Launcher(lambda: stream, False))
        kind = "value" if conv._items["y"] == math.prod(spec.output_shape) else "strip"
        return kind, "fast" if conv._fast_partials else "simple"

    with breakdown.depthwise_variant(variant):
        assert built() == (forward, weights)
    assert built() == ("strip", "fast")


@pytest.mark.parametrize("row", ["train", "act"])
def test_the_networks_benchmarks_captured_steps_keep_their_model_and_optimizer_alive(row):
    """A CUDA graph holds the addresses its capture used, not the tensors: the replay that
    bench_networks.py times must keep the model (and the training step's optimizer, whose
    state it updates) alive after the caller drops them, or replays write into blocks
    torch's allocator hands to others."""
    import gc
    import weakref

    from conftest import HAVE_GPU, NO_GPU_REASON
    if not HAVE_GPU:
        pytest.skip(NO_GPU_REASON)
    torch = pytest.importorskip("torch")
    import bench_networks

    model = bench_networks.network("digits_cnn").to("cuda", memory_format=torch.channels_last)
    x = torch.randn(4, 1, 8, 8, device="cuda").contiguous(memory_format=torch.channels_last)
    if row == "train":
        replay = bench_networks.training_step(model, "graph", x, torch.randn(4, 10, device="cuda"))
    else:
        replay = bench_networks.acting_step(model, "graph", x, bench_networks.Timer("cuda"))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is not None
    replay()
    torch.cuda.synchronize()
    del replay
    gc.collect()
    assert alive() is None  # nothing else held it: the replay was what kept it
