"""The Qwen vision towers' patch embedding as the matrix product it is.

A Qwen vision tower embeds each patch with a ``Conv3d`` whose kernel is its stride (2 frames x 14 x 14
pixels, no padding, no groups): each output is one patch against the kernel, so the convolution is a
linear map of the flattened patch::

    pixel_values [patches, C*T*P*P]  @  weight.view(embed_dim, C*T*P*P).T  (+ bias)  ->  [patches, embed_dim]

PyTorch runs it as a convolution all the same: on this CPU, 271 ms for a 1024x1024 image's 5,329 patches
against 75 ms as one matrix product, and on some GPUs and dtypes cuDNN's convolution for this shape is
slower still by orders of magnitude (vLLM runs it as a matrix product for that reason; transformers has
the same substitution as an opt-in fusion). transformers' fusion patches the module class for the whole
process and rewrites the checkpoint's weight names on load; the worker wants it for its own model only
(a reference model loaded beside it, as the tests do, stays stock), so ``use_linear_patch_embed``
replaces the forward of the one module, reading the same weight through a view.

Only rounding differs, and the worker does it on CUDA only: there bf16 rounds far more than the two
sums' order (the CUDA tier's near-tie rule), while on the CPU, in fp32, the other order moves the tiny
checkpoints' logprobs past the 5e-5 within which the worker's agree with transformers' (the tests'
bound).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def use_linear_patch_embed(patch_embed: nn.Module) -> bool:
    """Runs ``patch_embed`` (a module whose ``proj`` is a non-overlapping ``Conv3d``, fed flattened
    patches) as one matrix product; False, changing nothing, for any other module."""
    proj = getattr(patch_embed, "proj", None)
    if not (
        isinstance(proj, nn.Conv3d)
        and proj.stride == proj.kernel_size
        and proj.padding == (0, 0, 0)
        and proj.dilation == (1, 1, 1)
        and proj.groups == 1
    ):
        return False
    patch_volume = proj.in_channels * math.prod(proj.kernel_size)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = proj.weight.view(proj.out_channels, patch_volume)
        return F.linear(hidden_states.reshape(-1, patch_volume).to(weight.dtype), weight, proj.bias)

    patch_embed.forward = forward
    return True
