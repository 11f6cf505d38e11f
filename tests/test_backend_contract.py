"""Both backends provide every function of the declared contract (conv2d.backend.Functions),
with its parameter names, order and defaults; the CUDA backend also the preallocating
extension (conv2d.backend.Preallocating) that conv2d.torch asks for. A third backend reads
what to provide from the same declaration."""

import inspect

import pytest

from conv2d import backend

def _declared(protocol):
    """The functions a protocol of conv2d.backend declares, its bases' included."""
    return sorted({name for cls in protocol.__mro__ if cls.__module__ == backend.__name__
                   for name, member in vars(cls).items() if callable(member) and not name.startswith("_")})


CONTRACT = _declared(backend.Functions)


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


@pytest.mark.parametrize("name, protocol", [("reference", "Functions"), ("cuda", "Functions"),
                                            ("cuda", "Preallocating")])
def test_a_backend_provides_each_contract_function_with_its_parameters(name, protocol):
    declared = getattr(backend, protocol)
    cls = _backend_class(name)
    for function in _declared(declared):
        want = _parameters(getattr(declared, function))
        got = _parameters(getattr(cls, function))
        # An extension may add keyword parameters after the declared ones, with defaults.
        assert got[:len(want)] == want, f"{name}.{function}: {got} != declared {want}"
        assert all(not required for _, _, required in got[len(want):]), f"{name}.{function}: {got[len(want):]}"
    assert cls.name == name


def test_the_preallocating_extension_declares_what_conv2d_torch_calls_beyond_the_contract():
    assert {"deferred_frees", "follow", "release", "release_all"} <= set(_declared(backend.Preallocating)) - set(
        CONTRACT)
