"""Build tiny, randomly initialised Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints for tests and benchmarks.

Each folder looks like a real Qwen checkpoint: the family's config classes, tokenizer.json and
tokenizer_config.json, preprocessor_config.json (``Qwen2VLImageProcessorPil`` with the family's real
pixel bounds), video_preprocessor_config.json (the family's video processor with small pixel bounds),
chat_template.jinja, fp32 model.safetensors and a generation config. The model is tiny
(hidden 128, 2 LM layers, GQA 4/2 heads) but the vision geometry is the real one: patch 14 (Qwen3-VL: 16),
spatial merge 2, temporal patch 2; Qwen2.5-VL's window attention (window_size 112) with both window and
full-attention blocks; Qwen3-VL's deepstack levels and interleaved M-RoPE. M-RoPE sections are the real
ones scaled to the tiny head dim. Everything is generated locally and deterministically from ``seed``.
Load the processor with ``workers.families.qwen_vl.hf_processor.ImageOnlyQwenVLProcessor``; video frames
go through ``workers.families.qwen_vl.video_processing`` (HF's ``AutoProcessor`` loads the whole processor,
video processor included, where torchvision is installed: tests/reference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from workers.families.qwen_vl.tiny_templates import (
    QWEN2_5_TOOLS_CHAT_TEMPLATE,
    QWEN2_CHAT_TEMPLATE,
    QWEN3_CHAT_TEMPLATE,
)
from workers.families.tiny_common import (
    construct,
    init_weights,
    silent_token_ids,
    train_byte_level_bpe,
    write_checkpoint,
)

BPE_VOCAB_SIZE = 2048  # trained byte-level merges; the 14 Qwen specials come after them, in Qwen's order
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer): digits one by one, words with a leading space
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
SPECIALS = [
    ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", VISION_START, VISION_END, "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD,
]  # fmt: skip
# The tokens the real tokenizers add after the 14 specials, in their order, none of them special:
# Qwen2.5's (Qwen2.5-VL's) tool-call and fill-in-the-middle tokens, and Qwen3's tool responses and
# thinking markers on top (Qwen3-VL's). Qwen2-VL's tokenizer has none of them.
QWEN2_5_ADDED = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
QWEN3_ADDED = (*QWEN2_5_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>")
MAX_POSITION_EMBEDDINGS = 32768

# Why these gains (tiny_common.init_weights has the rest): a variance-preserving init alone already
# makes greedy text depend on the image; sharper attention makes outputs diverge from the first tokens on.
# The LM's attention logits ×4: q_proj and k_proj ×2, and for Qwen3-VL, whose q_norm / k_norm undo any
# projection scale, those norm weights 2. The vision tower's fused qkv: q and k rows ×2. lm_head ×6
# gives logits of std ≈ 6, mildly peaked (median top-1/top-2 gap ≈ 1.2 logits), so fp32 kernel noise
# does not flip greedy choices. Measured with seeds 0-3, one prompt, 16 tokens: 8 noise, 8 solid-colour,
# 8 blob and 8 mixed (noise, colours, shapes) 224x224 images give 8/8 distinct outputs in every family,
# ~15 different tokens per output, and 7.8-7.9 of 8 differ already in their first 4 tokens (6.5-6.7
# without the q/k gains).
GAINS = {"q_proj": 2.0, "k_proj": 2.0, "q_norm": 2.0, "k_norm": 2.0, "lm_head": 6.0}
VISION_QK_GAIN = 2.0
EMBEDDINGS = ("embed_tokens", "pos_embed")


@dataclass(frozen=True)
class _Video:
    """What video_preprocessor_config.json holds beyond the image processor's settings."""

    processor_class: str
    size: dict[str, int]  # pixel bounds (see the families below)
    extra: dict[str, Any]  # what else the family's video processor serialises


@dataclass(frozen=True)
class _Family:
    config_class: type[Qwen2VLConfig | Qwen2_5_VLConfig | Qwen3VLConfig]
    model_class: type[PreTrainedModel]
    processor_class: str  # the stock processor a real checkpoint names (it needs torchvision for video)
    video: _Video
    chat_template: str
    patch_size: int
    min_pixels: int  # the real checkpoint's preprocessor_config.json
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    vision: dict[str, Any]
    rope_parameters: dict[str, Any]
    text: dict[str, Any]
    added_tokens: tuple[str, ...] = ()  # non-special tokens after the specials
    tokenizer_chat_template: str | None = None  # the tokenizer's own, where it differs from the processor's


CLIP_MEAN, CLIP_STD = tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD)  # Qwen2 and Qwen2.5 normalize as CLIP
_QWEN2_MIN_PIXELS, _QWEN2_MAX_PIXELS = 56 * 56, 12845056  # 4..16384 tokens of 28x28 px
# Video pixel bounds, small for the tiny vision tower (the real ones allow up to 768 tokens per frame).
# Qwen2VLVideoProcessor bounds each frame: 64..256 tokens of 28x28 px (256..1024 patches) per frame.
# Qwen3VLVideoProcessor bounds all sampled frames together: 4..2048 tokens of 32x32 px over the clip
# (8 frames: up to 1024 patches each; 32 frames: up to 256).
_QWEN2_VIDEO = _Video(
    "Qwen2VLVideoProcessor",
    size={"shortest_edge": 64 * 28 * 28, "longest_edge": 256 * 28 * 28},
    extra={"do_sample_frames": False, "max_video_tokens": 128000},
)
_QWEN3_VIDEO = _Video(
    "Qwen3VLVideoProcessor",
    size={"shortest_edge": 4 * 32 * 32, "longest_edge": 2048 * 32 * 32},
    extra={"do_sample_frames": True, "fps": 2, "max_video_tokens": 768},
)
FAMILIES: dict[str, _Family] = {
    "qwen2_vl": _Family(
        Qwen2VLConfig, Qwen2VLForConditionalGeneration, "Qwen2VLProcessor", _QWEN2_VIDEO, QWEN2_CHAT_TEMPLATE,
        patch_size=14, min_pixels=_QWEN2_MIN_PIXELS, max_pixels=_QWEN2_MAX_PIXELS,
        image_mean=CLIP_MEAN, image_std=CLIP_STD,
        vision={"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 4},
        # the real [16, 24, 24] of head_dim 128, scaled to 32
        rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e6},
        text={},
    ),
    "qwen2_5_vl": _Family(
        Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLProcessor", _QWEN2_VIDEO,
        QWEN2_CHAT_TEMPLATE, patch_size=14, min_pixels=_QWEN2_MIN_PIXELS, max_pixels=_QWEN2_MAX_PIXELS,
        image_mean=CLIP_MEAN, image_std=CLIP_STD,
        # window_size 112 px = 4x4 merged tokens per window; blocks 1 and 3 attend over the whole image
        vision={"depth": 4, "hidden_size": 64, "out_hidden_size": 128, "intermediate_size": 128,
                "num_heads": 4, "window_size": 112, "fullatt_block_indexes": [1, 3]},
        rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e6},
        text={}, added_tokens=QWEN2_5_ADDED, tokenizer_chat_template=QWEN2_5_TOOLS_CHAT_TEMPLATE,
    ),
    "qwen3_vl": _Family(
        Qwen3VLConfig, Qwen3VLForConditionalGeneration, "Qwen3VLProcessor", _QWEN3_VIDEO, QWEN3_CHAT_TEMPLATE,
        patch_size=16, min_pixels=65536, max_pixels=16777216,  # 64..16384 tokens of 32x32 px
        image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
        vision={"depth": 3, "hidden_size": 64, "out_hidden_size": 128, "intermediate_size": 128,
                "num_heads": 4, "num_position_embeddings": 2304, "deepstack_visual_indexes": [0, 1]},
        # the real [24, 20, 20] of head_dim 128, interleaved (THWTHW...) rather than in blocks
        rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True,
                         "rope_theta": 5e6},
        text={"head_dim": 32, "rms_norm_eps": 1e-6}, added_tokens=QWEN3_ADDED,
    ),
}  # fmt: skip


def build_tiny(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """Write the tiny ``family`` checkpoint ("qwen2_vl", "qwen2_5_vl" or "qwen3_vl") into ``out_dir`` and
    return its path; about a second on a CPU.

    Same ``seed`` ⇒ bit-identical files; the seed changes the weights only (the tokenizer is fixed). An
    existing checkpoint folder is replaced; a non-empty folder that is not a checkpoint is refused.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown Qwen-VL family {family!r}; known: {sorted(FAMILIES)}")
    return write_checkpoint(out_dir, lambda folder: _write(folder, FAMILIES[family], seed))


def _write(out_path: Path, spec: _Family, seed: int) -> None:
    tokenizer = _build_tokenizer(spec.added_tokens)
    if spec.tokenizer_chat_template is None:
        tokenizer.chat_template = spec.chat_template
        tokenizer.save_pretrained(out_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    else:  # as the real checkpoint: the processor's in chat_template.json, the tokenizer's in its config
        tokenizer.chat_template = spec.tokenizer_chat_template
        tokenizer.save_pretrained(out_path, save_jinja_files=False)
        text = json.dumps({"chat_template": spec.chat_template}, indent=2) + "\n"
        (out_path / "chat_template.json").write_text(text, encoding="utf-8")
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=spec.patch_size,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=list(spec.image_mean),
        image_std=list(spec.image_std),
    )
    # saved like every attribute of an image processor, though transformers declares no such one
    image_processor.processor_class = spec.processor_class  # type: ignore[attr-defined]
    image_processor.save_pretrained(out_path)
    _write_video_processor_config(out_path, spec)

    model = construct(spec.model_class, _build_config(spec, tokenizer))
    init_weights(
        model,
        seed,
        gains=GAINS,
        embeddings=EMBEDDINGS,
        # nor a tool call: a random model would open one at random; tests push it with logit_bias
        silent_token_ids=[*silent_token_ids(tokenizer), *_ids(tokenizer, spec.added_tokens)],
        rows_gain=_vision_qkv_gain,
    )
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.pad_token_id,  # Qwen has no BOS; its configs name <|endoftext|>
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_path)


def _ids(tokenizer: PreTrainedTokenizerFast, tokens: tuple[str, ...]) -> list[int]:
    return [int(tokenizer.convert_tokens_to_ids(token)) for token in tokens]  # type: ignore[arg-type]


def _write_video_processor_config(out_path: Path, spec: _Family) -> None:
    """video_preprocessor_config.json as ``save_pretrained`` of the family's video processor writes it
    (written by hand: HF's video processors need torchvision). ``cap_pixels_per_frame`` is left out, as in
    the real checkpoints: HF then keeps the uncapped behaviour (and warns)."""
    config = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(spec.image_mean),
        "image_std": list(spec.image_std),
        "max_frames": 768,
        "merge_size": 2,
        "min_frames": 4,
        "patch_size": spec.patch_size,
        "processor_class": spec.processor_class,
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "return_metadata": False,
        "size": dict(spec.video.size),
        "temporal_patch_size": 2,
        "video_processor_type": spec.video.processor_class,
        **spec.video.extra,
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (out_path / "video_preprocessor_config.json").write_text(text, encoding="utf-8")


def _vision_qkv_gain(name: str, param: torch.Tensor) -> torch.Tensor | None:
    """Per-row gains of a vision block's fused qkv projection: the q and k thirds sharpened, v left."""
    if not (name.startswith("model.visual.blocks.") and name.endswith("attn.qkv.weight")):
        return None
    gains = torch.ones(param.shape[0])
    gains[: 2 * param.shape[0] // 3] = VISION_QK_GAIN
    return gains


def _build_tokenizer(added_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Qwen2's tokenizer shape: byte-level BPE with NFC and Qwen2's split, no BOS, <|im_end|> as EOS and
    <|endoftext|> as pad; the image, video and vision marker tokens reachable by name; ``added_tokens``
    after the specials, not special (split out of text whole, kept by ``skip_special_tokens``)."""
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok = train_byte_level_bpe(BPE_VOCAB_SIZE, [], SPECIALS, pre_tokenizer)
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    tok.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens={
            "image_token": IMAGE_PAD,
            "video_token": VIDEO_PAD,
            "vision_start_token": VISION_START,
            "vision_end_token": VISION_END,
        },
        padding_side="left",
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )


def _build_config(
    spec: _Family, tokenizer: PreTrainedTokenizerFast
) -> Qwen2VLConfig | Qwen2_5_VLConfig | Qwen3VLConfig:
    vocab = tokenizer.get_vocab()
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_parameters": dict(spec.rope_parameters),  # the config completes it in place
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        **spec.text,
    }
    vision_config = {
        "patch_size": spec.patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **spec.vision,
    }
    return spec.config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=vocab[IMAGE_PAD],
        video_token_id=vocab[VIDEO_PAD],
        vision_start_token_id=vocab[VISION_START],
        vision_end_token_id=vocab[VISION_END],
        tie_word_embeddings=False,
        dtype="float32",
    )
