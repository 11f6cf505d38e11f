"""bfloat16 and float16 bits on the device, and the load and store of each storage format:
what every kernel set (fast.py, simple.py) reads and writes values with. Storage arrays
are float32, float16, or uint16 holding bfloat16 bits; every value is float32 once
loaded."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from conv2d.cuda.runtime import numba_cuda, simulating

cuda = numba_cuda()
f32 = np.float32

# bfloat16 <-> float32 bit conversions. On a GPU through libdevice's bit casts; numba's
# simulator has no libdevice, so there the same conversion goes through NumPy views.
if simulating():
    @cuda.jit(device=True)
    def bf16_to_f32(bits):
        return np.array([np.uint32(bits) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_to_bf16(v):
        if v != v:
            return np.uint16(0x7FC0)
        u = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
        return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)

    @cuda.jit(device=True)
    def load_u64(a, j):
        item = a.dtype.itemsize
        return np.ascontiguousarray(a[j * (8 // item):(j + 1) * (8 // item)]).view(np.uint64)[0]

    @cuda.jit(device=True)
    def f16_bits_to_f32(bits):
        return np.float32(np.array([bits], dtype=np.uint16).view(np.float16)[0])

    @cuda.jit(device=True)
    def f32_from_bits(bits):
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def store_u64(a, j, bits):
        n = 8 // a.dtype.itemsize
        a[j * n:(j + 1) * n] = np.array([bits], dtype=np.uint64).view(a.dtype)

    @cuda.jit(device=True)
    def f16_encode_bits(v):
        return np.uint32(np.array([np.float16(v)], dtype=np.float16).view(np.uint16)[0])

    @cuda.jit(device=True)
    def f32_bits(v):
        return np.uint32(np.array([v], dtype=np.float32).view(np.uint32)[0])
else:
    from llvmlite import ir
    from numba.core import types as nb_types
    from numba.core.extending import intrinsic
    from numba.cuda import libdevice

    @intrinsic
    def _cvt_rn_bf16(typingctx, v):
        # PTX's own float32 -> bfloat16 conversion (round to nearest even, sm_80+): one
        # instruction where the bit arithmetic took numba's 64-bit integer promotion and
        # about 30 more registers a thread in the bfloat16 row kernels.
        def codegen(context, builder, signature, args):
            fn = ir.FunctionType(ir.IntType(16), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fn, "cvt.rn.bf16.f32 $0, $1;", "=h,f"), args)
        return nb_types.uint16(nb_types.float32), codegen

    @intrinsic
    def load_u64(typingctx, a, j):
        # The 8 bytes at byte offset 8 * j of array a's data, one load instruction (the
        # caller keeps j in range and the data 8-byte aligned).
        if not isinstance(a, nb_types.Array) or not isinstance(j, nb_types.Integer):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
            index = context.cast(builder, args[1], signature.args[1], nb_types.intp)
            ptr = builder.gep(builder.bitcast(data, ir.IntType(64).as_pointer()), [index])
            return builder.load(ptr, align=8)
        return nb_types.uint64(a, j), codegen

    @intrinsic
    def store_u64(typingctx, a, j, bits):
        # Stores the 8 bytes `bits` at byte offset 8 * j of array a's data, one store
        # instruction (the caller keeps j in range and the data 8-byte aligned).
        if not isinstance(a, nb_types.Array) or not isinstance(j, nb_types.Integer):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
            index = context.cast(builder, args[1], signature.args[1], nb_types.intp)
            value = context.cast(builder, args[2], signature.args[2], nb_types.uint64)
            ptr = builder.gep(builder.bitcast(data, ir.IntType(64).as_pointer()), [index])
            builder.store(value, ptr, align=8)
            return context.get_dummy_value()
        return nb_types.void(a, j, bits), codegen

    @intrinsic
    def _f16_encode_bits(typingctx, v):
        # The float16 bits of float32 v, rounded as numba's own float32 -> float16 store
        # rounds it (the same fptrunc).
        def codegen(context, builder, signature, args):
            h = builder.fptrunc(args[0], ir.HalfType())
            return builder.zext(builder.bitcast(h, ir.IntType(16)), ir.IntType(32))
        return nb_types.uint32(nb_types.float32), codegen

    @cuda.jit(device=True, inline=True)
    def f16_encode_bits(v):
        return _f16_encode_bits(f32(v))

    @cuda.jit(device=True, inline=True)
    def f32_bits(v):
        return np.uint32(libdevice.float_as_int(v))

    @intrinsic
    def _f16_bits_to_f32(typingctx, bits):
        def codegen(context, builder, signature, args):
            h = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
            return builder.fpext(h, ir.FloatType())
        return nb_types.float32(bits), codegen

    @cuda.jit(device=True, inline=True)
    def f16_bits_to_f32(bits):
        return _f16_bits_to_f32(np.uint32(bits))

    @cuda.jit(device=True, inline=True)
    def f32_from_bits(bits):
        return libdevice.int_as_float(np.int32(bits))

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(bits):
        return libdevice.int_as_float(np.int32(bits) << np.int32(16))

    @cuda.jit(device=True, inline=True)
    def f32_to_bf16(v):
        # NaN as NumPy's and ml_dtypes' casts give it (cvt gives another NaN pattern).
        if v != v:
            return np.uint16(0x7FC0)
        return _cvt_rn_bf16(v)


# Each storage format as four conversions, float32 values in and out: of an array element
# (`from_element`, `to_element`) and of its bits as uint32 (`from_bits`, `to_bits`), with the
# bit width (the 8 bytes of `load_u64` hold 64 // width values).
@cuda.jit(device=True, inline=True)
def _as_f32(e):
    return f32(e)


@cuda.jit(device=True, inline=True)
def _to_f16(v):
    return np.float16(v)


_FORMATS = {
    "bfloat16": (bf16_to_f32, f32_to_bf16, bf16_to_f32, f32_to_bf16, 16),
    "float16": (_as_f32, _to_f16, f16_bits_to_f32, f16_encode_bits, 16),
    "float32": (_as_f32, _as_f32, f32_from_bits, f32_bits, 32),
}


class StorageIO(NamedTuple):
    """A storage format's device functions, float32 values in and out: `load(a, i)`,
    `store(a, i, v)`; `stored(a, i, v)` stores v and returns the value as stored, back in
    float32; `part(raw, v)` is value v of 8 raw bytes (`load_u64`) as float32;
    `encode(v)` is (the bits `stored` would store, as uint64; the value as stored)."""

    load: Any
    store: Any
    stored: Any
    part: Any
    encode: Any


def storage_io(storage: str) -> StorageIO:
    """The device functions of storage format `storage` (see StorageIO)."""
    if storage not in _FORMATS:
        raise ValueError(f"storage_io: storage {storage!r}, expected one of {sorted(_FORMATS)}")
    from_element, to_element, from_bits, to_bits, width = _FORMATS[storage]
    WIDTH, MASK = np.uint64(width), np.uint64((1 << width) - 1)

    @cuda.jit(device=True, inline=True)
    def load(a, i):
        return from_element(a[i])

    @cuda.jit(device=True, inline=True)
    def store(a, i, v):
        a[i] = to_element(v)

    @cuda.jit(device=True, inline=True)
    def stored(a, i, v):
        e = to_element(v)
        a[i] = e
        return from_element(e)

    @cuda.jit(device=True, inline=True)
    def part(raw, v):
        return from_bits(np.uint32((raw >> (WIDTH * np.uint64(v))) & MASK))

    @cuda.jit(device=True, inline=True)
    def encode(v):
        bits = to_bits(v)
        return np.uint64(bits), from_bits(bits)
    return StorageIO(load, store, stored, part, encode)
