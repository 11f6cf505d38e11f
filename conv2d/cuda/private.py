"""Every private API the CUDA backend uses, in one module, each beside the public path it
must agree with. The backend option `fast_paths=False` takes the public paths, and tests
compare the bits of the two (tests/test_cuda_capture.py), so that a numba or cudnn-frontend
release that moves one of these shows up as a failing test, with a working fallback.

- numba, kernel launches: `packed_launch` packs a kernel's arguments as numba's
  dispatcher does (`_Kernel._prepare_args`) and finds its CUfunction (`_codelibrary`), so
  that `launch.Launch` calls `cuLaunchKernel` itself (25-50 us of host time less a launch).
  Public path: calling the dispatcher.
- numba, device arrays over memory owned elsewhere: `array_over` builds `DeviceNDArray`
  and `MemoryPointer` directly (no context check, no driver call): the layer's output
  blocks (memory.OutputAllocator) and torch tensors (`tensor_view`). Public path:
  `from_cuda_array_interface` (`interface_view`).
- torch, the current stream: `torch_raw_stream` reads it through torch's C binding
  (`_cuda_getCurrentRawStream`, an int) rather than building a `torch.cuda.Stream`
  object on every call. Public path: `torch.cuda.current_stream(device).cuda_stream`.
- cudnn-frontend, execution: `native_execute` prepares the frontend's native entry point
  over an array of pointers in the graph's uid order (`_execute_with_raw_ptrs`), 6 us
  against 25-30 us for `execute`. Public path: `graph.execute({uid: pointer}, workspace, handle=)`.
- numba's CUDA simulator, for tests: `yielding_simulator` makes the simulator's block
  manager let go of the GIL while it polls the block's threads (see there). Public path:
  the simulator as it is, slower.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Callable

import numpy as np

from conv2d.checks import c_contiguous_strides


# numba: launches ------------------------------------------------------------------------
def packed_launch(kernel: Any, args: list, stream: Any) -> tuple[list, list[int], int] | None:
    """(ctypes slots of the packed arguments, the slot of each argument's value (an
    array's data pointer, a scalar itself), the kernel's CUfunction handle) for `kernel`
    (a numba dispatcher) called with `args`, or None where numba packs them in a way this
    does not know (the dispatcher then stays)."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    compiled = kernel.compile(argtypes)
    compiled.bind()
    packed, starts, retr = [], [], []
    for ty, value in zip(compiled.argument_types, args):
        starts.append(len(packed))
        compiled._prepare_args(ty, value, stream, retr, packed)
    slots = []
    for v in packed:
        if isinstance(v, (bool, np.bool_)):
            slots.append(ctypes.c_bool(bool(v)))
        elif isinstance(v, int):
            slots.append(ctypes.c_int64(v))  # numba passes array fields as intptr_t
        elif isinstance(v, ctypes._SimpleCData):
            slots.append(v)
        else:
            return None
    # An array's data pointer is the fifth of its fields (meminfo, parent, nitems,
    # itemsize, data, shape..., strides...): checked against the array itself.
    value_slots = []
    for start, a in zip(starts, args):
        ptr = getattr(a, "device_ctypes_pointer", None)
        if ptr is None:
            value_slots.append(start)
        elif slots[start + 4].value == int(ptr.value or 0):
            value_slots.append(start + 4)
        else:
            return None
    return slots, value_slots, int(compiled._codelibrary.get_cufunc().handle)


# numba: device arrays over memory owned elsewhere ----------------------------------------
def array_over(context: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype, stream: Any = 0,
               owner: Any = None, finalizer: Callable[[], None] | None = None) -> Any:
    """A C-contiguous numba device array of `shape` and `dtype` at device address `ptr` in
    numba context `context`; `owner` is kept alive by it, `finalizer` runs when it is
    collected."""
    from numba.cuda.cudadrv import devicearray
    from numba.cuda.cudadrv import driver as numba_driver

    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # math.prod: np.prod costs microseconds a call
    memory = numba_driver.MemoryPointer(context, numba_driver.binding.CUdeviceptr(ptr), nbytes, owner=owner,
                                        finalizer=finalizer)
    return devicearray.DeviceNDArray(shape, c_contiguous_strides(shape, dtype.itemsize), dtype, stream=stream,
                                     gpu_data=memory)


# numba's public import (`from_cuda_array_interface`) checks the current context on every
# call through its thread-local cache, which is empty in threads numba did not start:
# measured on the H200, 11-14 us a tensor on the main thread, and the autograd engine's
# CUDA thread (where a module's backward runs) paid far more. A torch tensor's memory is
# in the primary context of its device, looked up once a device.
_CONTEXTS: dict[int, Any] = {}


def tensor_view(cuda: Any, t: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A numba device array of `shape` and `dtype` (C-contiguous) over the memory of the
    torch CUDA tensor t (kept alive by the array), no copy and no driver call."""
    device = t.get_device()
    context = _CONTEXTS.get(device)
    if context is None:
        context = _CONTEXTS[device] = cuda.gpus[device].get_primary_context()
    return array_over(context, t.data_ptr(), shape, dtype, owner=t)


def interface_view(cuda: Any, t: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """`tensor_view` through numba's public `from_cuda_array_interface`."""
    iface = {"shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (t.data_ptr(), False), "version": 2,
             "strides": None}
    return cuda.from_cuda_array_interface(iface, owner=t, sync=False)


# torch: the current stream -----------------------------------------------------------------
def torch_raw_stream(device: int) -> int:
    """The CUstream of torch's current stream on CUDA device `device`, as an int."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


# cudnn-frontend: execution -----------------------------------------------------------------
def native_execute(graph: Any, uids: dict[str, int], handle: Any, workspace_ptr: int) -> tuple:
    """(entry point, its arguments, the ctypes pointer array, role -> index in that array)
    for executing the built frontend `graph` through its native pointer-array entry point;
    the array is filled by the caller. Raises LookupError where this frontend or this
    graph's plan does not offer it (then the public execute stays)."""
    from cudnn._handle import to_backend_handle

    if getattr(graph, "selected_engine", None) is not None:
        raise LookupError("the plan is one of the frontend's Python engines, not a backend plan")
    order = [int(u) for u in graph._variant_pack_uids()]
    if sorted(order) != sorted(uids.values()):
        raise LookupError("the graph's variant pack has other tensors")
    cfg = graph._materialize_backend_plan(graph._plan_index) if graph._plans else None
    cpp_index = -1 if cfg is None or cfg.cpp_index is None else int(cfg.cpp_index)
    array = (ctypes.c_void_p * len(order))()
    slots = {role: order.index(uid) for role, uid in uids.items()}
    entry = graph._lowered_graph._execute_with_raw_ptrs
    args = (ctypes.addressof(array), len(order), workspace_ptr, to_backend_handle(handle) or 0, cpp_index)
    return entry, args, array, slots


# numba: the CUDA simulator (tests) ----------------------------------------------------------
def yielding_simulator() -> None:
    """Make numba's CUDA simulator yield the GIL each time its block manager asks whether
    a thread of the block is alive. The manager polls the block's threads (one Python
    thread per CUDA thread) in a loop that never releases the GIL itself, so each thread
    it waits for got the GIL only at the interpreter's switch interval: the same
    simulator test took 5 s or 130 s from run to run (CI, 2 cores), and the depthwise
    tests 25-350 s, against 19-20 s with this. The threads and what they compute are
    unchanged. Call it before any kernel runs, only where NUMBA_ENABLE_CUDASIM is set;
    calling it again changes nothing."""
    import time

    from numba.cuda.simulator import kernel

    thread = kernel.BlockThread
    if getattr(thread.is_alive, "yields", False):
        return
    polled = thread.is_alive

    def is_alive(self) -> bool:
        time.sleep(0)  # releases the GIL: a waiting block thread runs now
        return polled(self)
    is_alive.yields = True
    thread.is_alive = is_alive
