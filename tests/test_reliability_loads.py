"""A load's memory is bounded by the arrays' own size, whatever the file claims, and a
damaged file is refused up front, not after a timeout (reliability III): compressed .npz
members, zip directories larger than the file, HDF5 chunks larger than their dataset, a
damaged HDF5 global heap."""

import os
import shutil
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

import conv2d
from conftest import make_layer, small_layer_spec
from conv2d import Conv2d, LayerSpec

SPEC = small_layer_spec()


def _saved(tmp_path, spec=SPEC):
    layer = make_layer(spec)
    path = tmp_path / "layer.npz"
    conv2d.save(layer, path)
    return layer, path


def test_a_compressed_member_is_refused_before_it_is_inflated(tmp_path):
    _, path = _saved(tmp_path)
    packed = tmp_path / "packed.npz"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(ValueError, match=r"compressed members .*refused before inflating"):
        conv2d.load(packed)


def test_a_directory_declared_past_the_files_end_is_refused_unread(tmp_path):
    _, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x05\x06")
    data[at + 12:at + 16] = (1_500_000_000).to_bytes(4, "little")  # a 1.5 GB central directory
    sparse = tmp_path / "sparse.npz"
    with open(sparse, "wb") as f:
        f.truncate(1 << 31)  # a sparse file: the declared directory would fit its size
        f.seek((1 << 31) - len(data))
        f.write(data)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="zip directory of 1500000000 bytes"):
            conv2d.load(sparse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_file_without_a_zip_end_record_is_a_value_error(tmp_path):
    _, path = _saved(tmp_path)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(ValueError, match="not a readable conv2d file"):
        conv2d.load(cut)


def _rltools_file(tmp_path):
    pytest.importorskip("h5py", reason="h5py is not installed (the hdf5 extra brings it)")
    from conv2d import rltools

    spec = LayerSpec(batch_size=1, in_height=6, in_width=6, in_channels=2, out_channels=3, kernel=3, padding=1,
                     normalization="batch_norm", activation="relu", dtype="float32")
    layer = Conv2d(spec)
    layer.init_weights(np.random.default_rng(0))
    path = tmp_path / "layer.h5"
    rltools.save(layer, path)
    return rltools, spec, path


def test_an_hdf5_chunk_larger_than_its_dataset_is_refused_unread(tmp_path):
    import h5py

    rltools, spec, path = _rltools_file(tmp_path)
    with h5py.File(path, "a") as f:
        values = f["layer/running_mean"][()]
        del f["layer/running_mean"]
        f["layer"].create_dataset("running_mean", data=values, chunks=(2 ** 28,), maxshape=(None,),
                                  compression="gzip")
    assert os.path.getsize(path) < 8 << 20
    with pytest.raises(ValueError, match=r"running_mean: stored in chunks of \(268435456,\) values"):
        rltools.load(path, into=Conv2d(spec))


def test_a_damaged_global_heap_object_size_is_refused_at_once(tmp_path):
    rltools, spec, path = _rltools_file(tmp_path)
    data = bytearray(path.read_bytes())
    # The heap's first one-character string object (a 16-byte header: index, count,
    # reserved, size; then its data padded to 8): its size 1 -> 0x11, the one-byte change
    # that made the library spin.
    at = data.find(b"GCOL") + 16
    while int.from_bytes(data[at + 8:at + 16], "little") != 1:
        at += 16 + (int.from_bytes(data[at + 8:at + 16], "little") + 7) // 8 * 8
    data[at + 8] = 0x11
    bad = tmp_path / "bad.h5"
    bad.write_bytes(bytes(data))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="global heap .* does not hold whole objects"):
        rltools.load(bad, into=Conv2d(spec))
    assert time.perf_counter() - start < 60  # refused up front, not by the reader's 120 s timeout


def test_the_global_heap_check_takes_every_file_rltools_writes(tmp_path):
    from conv2d.hdf5_safe import check_global_heaps

    _, _, path = _rltools_file(tmp_path)
    check_global_heaps(str(path), "here")  # no error
    copy = tmp_path / "copy.h5"
    shutil.copy(path, copy)
    check_global_heaps(str(copy), "here")


@pytest.mark.parametrize("make, message", [
    (lambda d: str(d / "a\x00b.npz"), "holds a NUL byte"),
    (lambda d: str(d / ("x" * 300)), "a name too long"),
    (lambda d: (os.symlink(d / "loop2", d / "loop1"), os.symlink(d / "loop1", d / "loop2"), str(d / "loop1"))[-1],
     "a loop of symbolic links"),
    (lambda d: "/proc/self/mem" if os.path.exists("/proc/self/mem") else pytest.skip("no /proc"),
     "cannot be read|not a readable"),
])
def test_paths_no_file_can_be_read_from_are_value_errors_naming_why(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message):
        conv2d.load(path)
    pytest.importorskip("h5py", reason="h5py is not installed (the hdf5 extra brings it)")
    from conv2d import rltools

    with pytest.raises(ValueError, match=message):
        rltools.load(path, into=Conv2d(SPEC))


def test_a_fifo_swapped_in_after_the_check_cannot_block_a_load(tmp_path):
    """The loaders open the path once, without blocking, and check what they opened: a
    FIFO is refused at once, whenever it appeared."""
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="not a regular file"):
        conv2d.load(fifo)
    assert time.perf_counter() - start < 5


def test_a_save_that_fails_on_disk_raises_one_error_and_prints_nothing(tmp_path):
    """rl_tools files are made in memory and written whole: a write over the file-size
    limit (as a full disk) is one OSError, with no "Exception ignored" tracebacks from h5py
    freeing its objects, and no file or temporary left."""
    import subprocess
    import sys

    pytest.importorskip("h5py", reason="h5py is not installed (the hdf5 extra brings it)")
    script = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from conv2d import Conv2d, LayerSpec, rltools
layer = Conv2d(LayerSpec(batch_size=1, in_height=6, in_width=6, in_channels=16, out_channels=64, kernel=3,
                         padding=1, normalization="batch_norm"))
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
try:
    rltools.save(layer, {str(tmp_path / 'big.h5')!r})
except OSError as e:
    print("OSError", e.errno)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("OSError") and done.stderr == "", (done.stdout, done.stderr[-2000:])
    assert list(tmp_path.iterdir()) == []
