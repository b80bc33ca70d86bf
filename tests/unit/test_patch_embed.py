"""The Qwen vision towers' patch embedding run as one matrix product (workers/patch_embed.py) against
transformers' own Conv3d forward, on the real module classes at the real checkpoints' sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

from workers.patch_embed import use_linear_patch_embed


def qwen3_vl_patch_embed() -> nn.Module:
    vision = Qwen3VLConfig().vision_config  # patch 16, 2 frames, 1152 wide, with a bias
    return Qwen3VLVisionPatchEmbed(vision)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=1280),
        lambda: Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=1280),
        qwen3_vl_patch_embed,
    ],
    ids=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"],
)
def test_the_matrix_product_gives_the_convolutions_embeddings(make) -> None:
    torch.manual_seed(0)
    module = make()
    if module.proj.bias is not None:
        nn.init.normal_(module.proj.bias)
    patches = torch.randn(300, module.proj.in_channels * module.proj.weight[0, 0].numel())
    expected = module(patches)
    assert use_linear_patch_embed(module) and "forward" in vars(module)  # this module's, not its class's
    got = module(patches)
    assert got.shape == expected.shape == (300, module.proj.out_channels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert module(patches.to(torch.bfloat16)).dtype == torch.float32  # cast to the weight's dtype, as before
    assert "forward" not in vars(make())  # the class is untouched


def test_other_modules_are_left_as_they_are() -> None:
    overlapping = nn.Module()
    overlapping.proj = nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 2, 2))
    no_conv = nn.Module()
    no_conv.proj = nn.Linear(4, 4)
    for module in (overlapping, no_conv, nn.Linear(4, 4)):
        assert not use_linear_patch_embed(module)
        assert "forward" not in vars(module)
