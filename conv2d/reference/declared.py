"""What the reference backend declares (conv2d.backend.Backend): NumPy on the host, every
dtype, no options, no stream, no graphs; forward keeps a view of the caller's x."""

from conv2d.backend import Backend


class ReferenceBackend(Backend):
    name = "reference"
    functions = "conv2d.reference.functional:Functions"
