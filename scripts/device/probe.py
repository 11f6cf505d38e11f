"""One-off probe of the GPU machine's stack (numba-cuda + numpy 2.5, cudnn frontend)."""
import os, sys, time, traceback
import numpy as np
print("numpy", np.__version__, "has row_stack", hasattr(np, "row_stack"))
added = False
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack; added = True
try:
    import numba.cuda.np.arrayobj  # noqa
    print("arrayobj imported")
finally:
    if added: del np.row_stack
from numba import cuda
from numba.cuda import libdevice
print("numba cuda available", cuda.is_available())
s = cuda.stream()
print("stream handle", type(s.handle), repr(s.handle), int(s.handle) if not hasattr(s.handle, "value") else s.handle.value)
@cuda.jit
def k(a, b):
    i = cuda.grid(1)
    if i < a.size:
        b[i] = libdevice.int_as_float(np.int32(a[i]) << 16)
a = cuda.to_device(np.array([0x3F80, 0x4000, 0xBF80], np.uint16)); b = cuda.device_array(3, np.float32)
k[1, 32, s](a, b); s.synchronize(); print("bf16 bits->f32", b.copy_to_host())
@cuda.jit
def h(a, b):
    i = cuda.grid(1)
    if i < a.size:
        b[i] = np.float16(np.float32(a[i]) * np.float32(2))
a = cuda.to_device(np.array([1, 2, 3], np.float16)); b = cuda.device_array(3, np.float16)
h[1, 32, s](a, b); s.synchronize(); print("f16", b.copy_to_host())
from cuda import pathfinder
dl = pathfinder.load_nvidia_dynamic_lib("cudnn"); print("pathfinder", dl.abs_path, dl.found_via)
import cudnn
print("cudnn fe", cudnn.__version__, "backend", cudnn.backend_version())
print("numerical notes", [n for n in dir(cudnn.numerical_note) if n.isupper()])
print("heur", [n for n in dir(cudnn.heur_mode) if n.isupper()])
import torch
hd = cudnn.create_handle(); cudnn.set_stream(hd, int(s.handle) if not hasattr(s.handle, "value") else s.handle.value)
N, C, H, W, K, OC = 8, 16, 32, 32, 3, 32
for dt, tdt in ((cudnn.data_type.FLOAT, torch.float32), (cudnn.data_type.BFLOAT16, torch.bfloat16)):
    try:
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT, handle=hd)
        X = g.tensor(name="x", dim=[N, C, H, W], stride=[H*W*C, 1, W*C, C], data_type=dt)
        Wt = g.tensor(name="w", dim=[OC, C, K, K], stride=[K*K*C, 1, K*C, C], data_type=dt)
        B = g.tensor(name="b", dim=[1, OC, 1, 1], stride=[OC, 1, OC, OC], data_type=dt)
        Y = g.conv_fprop(image=X, weight=Wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
        Z = g.bias(input=Y, bias=B)
        R = g.relu(input=Z)
        R.set_output(True).set_data_type(dt)
        g.validate(); g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
        g.check_support(); g.build_plans()
        ws = g.get_workspace_size(); print(dt, "plans", g.get_execution_plan_count(), "ws", ws)
        x = torch.randn(N, H, W, C, device="cuda", dtype=tdt); w = torch.randn(OC, K, K, C, device="cuda", dtype=tdt)*0.1; b = torch.randn(OC, device="cuda", dtype=tdt)
        y = torch.empty(N, H, W, OC, device="cuda", dtype=tdt); wsb = torch.empty(max(ws,1), device="cuda", dtype=torch.uint8)
        pack = {X: x.data_ptr(), Wt: w.data_ptr(), B: b.data_ptr(), R: y.data_ptr()}
        g.execute(pack, wsb.data_ptr(), handle=hd); torch.cuda.synchronize()
        ref = torch.relu(torch.nn.functional.conv2d(x.permute(0,3,1,2).float(), w.permute(0,3,1,2).float(), b.float(), padding=1)).permute(0,2,3,1)
        print(dt, "max err", (y.float()-ref).abs().max().item())
        t = time.perf_counter()
        for _ in range(100): g.execute(pack, wsb.data_ptr(), handle=hd)
        torch.cuda.synchronize(); print(dt, "execute host+gpu us", (time.perf_counter()-t)*1e4)
        # dgrad
        g2 = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT, handle=hd)
        DY = g2.tensor(name="dy", dim=[N, OC, H, W], stride=[H*W*OC, 1, W*OC, OC], data_type=dt)
        W2 = g2.tensor(name="w", dim=[OC, C, K, K], stride=[K*K*C, 1, K*C, C], data_type=dt)
        DX = g2.conv_dgrad(loss=DY, filter=W2, padding=[1,1], stride=[1,1], dilation=[1,1])
        DX.set_output(True).set_dim([N, C, H, W]).set_stride([H*W*C, 1, W*C, C]).set_data_type(dt)
        g2.validate(); g2.build_operation_graph(); g2.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g2.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC]); g2.check_support(); g2.build_plans()
        g3 = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT, handle=hd)
        X3 = g3.tensor(name="x", dim=[N, C, H, W], stride=[H*W*C, 1, W*C, C], data_type=dt)
        DY3 = g3.tensor(name="dy", dim=[N, OC, H, W], stride=[H*W*OC, 1, W*OC, OC], data_type=dt)
        DW = g3.conv_wgrad(image=X3, loss=DY3, padding=[1,1], stride=[1,1], dilation=[1,1])
        DW.set_output(True).set_dim([OC, C, K, K]).set_stride([K*K*C, 1, K*C, C]).set_data_type(cudnn.data_type.FLOAT)
        g3.validate(); g3.build_operation_graph(); g3.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g3.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC]); g3.check_support(); g3.build_plans()
        print(dt, "dgrad/wgrad built; ws", g2.get_workspace_size(), g3.get_workspace_size())
    except Exception:
        traceback.print_exc()
