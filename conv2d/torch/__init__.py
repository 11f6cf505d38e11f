"""The layer for PyTorch users (needs torch; `import conv2d` alone never imports it).

`Conv2dNormActivation` is a drop-in replacement for `nn.Sequential(nn.Conv2d,
nn.BatchNorm2d or nn.GroupNorm(1, C) or nothing, activation)` in a channels_last model,
with the same state_dict keys; `reference_sequential(module)` builds that Sequential.
`swap(model)` converts every conv -> norm -> activation chain a model's forward runs, in
place, each run of them in an nn.Sequential becoming one `Conv2dRun` (one autograd node
and one CUDA graph replay for consecutive layers); `SwapReport` says what it did, and
`unswap(model)` converts back."""

from conv2d.torch.module import Conv2dNormActivation, activation_module, reference_sequential
from conv2d.torch.runs import Conv2dRun
from conv2d.torch.swap import SwapReport, swap, unswap

__all__ = ["Conv2dNormActivation", "Conv2dRun", "SwapReport", "activation_module", "reference_sequential", "swap", "unswap"]
