"""Every backend provides every function of the declared contract (conv2d.backend.Functions),
with its parameter names, order and defaults; the CUDA backend also the preallocating
extension (conv2d.backend.Preallocating) that conv2d.torch asks for. A third backend reads
what to provide from the same declaration."""

import importlib
import inspect

import pytest

from conv2d import backend

def _declared(protocol):
    """The functions a protocol of conv2d.backend declares, its bases' included."""
    return sorted({name for cls in protocol.__mro__ if cls.__module__ == backend.__name__
                   for name, member in vars(cls).items() if callable(member) and not name.startswith("_")})


CONTRACT = _declared(backend.Functions)


def _backend_class(name):
    """The functions class backend `name` declares (skipped where its module cannot be
    imported here: numba-cuda missing)."""
    module, attr = backend.get(name).functions.split(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        pytest.skip(f"the {name} backend's functions cannot be imported here ({e}; the test extra brings numba-cuda)")


def _parameters(function):
    return [(p.name, p.kind, p.default is inspect.Parameter.empty)
            for p in inspect.signature(function).parameters.values()]


def test_the_contract_names_every_function_a_layer_and_the_optimizers_call():
    assert {"check_input", "forward", "evaluate", "saved", "backward", "pre_activations", "adam_step", "sgd_step",
            "from_host", "write", "read", "zero"} <= set(CONTRACT)


@pytest.mark.parametrize("name, protocol", [("reference", "Functions"), ("cpu", "Functions"), ("cuda", "Functions"),
                                            ("cuda", "Preallocating"), ("cpu", "Preparing")])
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


def _members(protocol):
    """The functions and properties a protocol of conv2d.backend declares itself."""
    return sorted(name for name, member in vars(protocol).items()
                  if (callable(member) or isinstance(member, property)) and not name.startswith("_"))


CAPABILITY_PROTOCOLS = {"has_stream": backend.Streamed, "captures_graphs": backend.Capturing,
                        "fills_outputs": backend.Preallocating, "prepares_evaluate": backend.Preparing}


@pytest.mark.parametrize("name", backend.backend_names())
def test_a_backend_provides_the_protocol_of_each_capability_it_declares(name):
    declared, cls = backend.get(name), _backend_class(name)
    assert cls.name == declared.name == name
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        if getattr(declared, capability):
            missing = [m for m in _members(protocol) if not hasattr(cls, m)]
            assert not missing, f"{name} declares {capability} but lacks {missing}"


def test_a_backend_registered_with_a_factory_declares_no_capabilities():
    backend.register_backend("test_factory_only", lambda spec, **options: None, options=("a",))
    try:
        declared = backend.get("test_factory_only")
        assert declared.options == ("a",) and declared.dtypes == backend.ALL_DTYPES
        assert not any(getattr(declared, c) for c in [*CAPABILITY_PROTOCOLS, "copies_host_input", "checks_repeats"])
        assert declared.unavailable() is None
        with pytest.raises(TypeError, match="takes \\['a'\\]; unknown \\['b'\\]"):
            declared.make(None, b=1)
    finally:
        backend._REGISTRY.pop("test_factory_only")
