"""Both backends provide every function of the declared contract (conv2d.backend.Functions),
with its parameter names, order and defaults; the CUDA backend also the preallocating
extension (conv2d.backend.Preallocating) that conv2d.torch asks for. A third backend reads
what to provide from the same declaration."""

import inspect

import pytest

from conv2d import backend

CONTRACT = [name for name, member in vars(backend.Functions).items()
            if callable(member) and not name.startswith("_")]


def _backend_class(name):
    if name == "cuda":
        pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (the test extra brings it)")
        from conv2d.cuda.functional import Functions
    else:
        from conv2d.reference.functional import Functions
    return Functions


def _parameters(function):
    return [(p.name, p.kind, p.default is inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()]


def test_the_contract_names_every_function_a_layer_and_the_optimizers_call():
    assert {"check_input", "forward", "evaluate", "saved", "backward", "pre_activations", "adam_step", "sgd_step",
            "from_host", "write", "read", "zero"} <= set(CONTRACT)


@pytest.mark.parametrize("protocol", ["Functions", "Preallocating"])
@pytest.mark.parametrize("name", ["reference", "cuda"])
def test_a_backend_provides_each_contract_function_with_its_parameters(name, protocol):
    if protocol == "Preallocating" and name == "reference":
        pytest.skip("the preallocating extension is the CUDA backend's")
    declared = getattr(backend, protocol)
    cls = _backend_class(name)
    for function in CONTRACT:
        want = _parameters(getattr(declared, function))
        got = _parameters(getattr(cls, function))
        # An extension may add keyword parameters after the declared ones, with defaults.
        assert got[:len(want)] == want, f"{name}.{function}: {got} != declared {want}"
        assert all(not required for _, _, required in got[len(want):]), f"{name}.{function}: {got[len(want):]}"
    assert cls.name == name
