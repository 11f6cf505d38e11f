"""conv2d/cuda/views.py: the address-only view of a torch tensor that prepared launches
read (no GPU needed: nothing here asks numba for its array)."""

import numpy as np
import pytest

from conv2d.cuda.launch import device_pointer
from conv2d.cuda.views import ForeignArray, as_numba

OWNER = object()


def test_a_foreign_array_has_the_size_and_address_it_was_given():
    a = ForeignArray(0x7F0000001000, (2, 3, 4, 5), np.dtype(np.float32), OWNER)
    assert (a.size, a.ndim, a.dtype) == (120, 4, np.float32)
    assert device_pointer(a) == 0x7F0000001000 == a.device_ctypes_pointer.value


@pytest.mark.parametrize("shape", [(120,), ((6, 20),), (6, 20)], ids=["flat", "tuple", "args"])
def test_reshape_keeps_the_address_and_the_owner(shape):
    a = ForeignArray(4096, (2, 3, 4, 5), np.dtype(np.uint16), OWNER)
    b = a.reshape(*shape)
    assert (b.ptr, b.owner, b.dtype, b.size) == (4096, OWNER, np.uint16, 120)
    assert b.shape == (tuple(shape[0]) if isinstance(shape[0], tuple) else tuple(shape))


def test_reshape_to_another_size_is_refused():
    with pytest.raises(ValueError, match="size 120 into shape"):
        ForeignArray(4096, (120,), np.dtype(np.float32), OWNER).reshape(121)


def test_as_numba_leaves_other_arrays_as_they_are():
    x = np.zeros(3)
    assert as_numba(x) is x
