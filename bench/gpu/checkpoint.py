"""A Qwen2.5-VL-7B-shaped checkpoint with random weights, made where it is served (no hub): the real
checkpoint's config sizes, the tiny Qwen2.5-VL's tokenizer, processor files and chat template
(workers/families/qwen_vl/tiny.py), weights drawn on the target device in its dtype.

    python bench/gpu/checkpoint.py OUT_DIR [--size 7b|dry] [--device cuda] [--dtype bfloat16]

The embedding and LM-head keep the real 152,064 rows, so a decode step reads as many weight bytes as the
real model's; the rows past the tiny tokenizer's ~2k ids (and its special ids) are zeroed in the LM head,
so greedy and sampled tokens are always ones the tokenizer can spell (their logit is 0 while the best
is several standard deviations up). Init is variance-preserving (N(0, 1/fan_in)), as the tiny builder's,
so activations stay O(1) through all 28 layers. ``--size dry`` is the same structure at toy sizes, for
the kit's dry run on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from transformers import AutoTokenizer, GenerationConfig  # noqa: E402

from workers.families.qwen_vl.tiny import FAMILIES, _build_config  # noqa: E402
from workers.families.tiny import build_tiny_model  # noqa: E402
from workers.families.tiny_common import silent_token_ids  # noqa: E402

# Qwen/Qwen2.5-VL-7B-Instruct's config.json
SIZES: dict[str, dict[str, Any]] = {
    "7b": {
        "text": {
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
            "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
        },
        "vision": {
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "out_hidden_size": 3584, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
        },
        "mrope_section": [16, 24, 24],
    },
    "dry": {
        "text": {
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 8192,
        },
        "vision": {
            "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 256,
            "window_size": 112, "fullatt_block_indexes": [1],
        },
        "mrope_section": [8, 12, 12],
    },
}  # fmt: skip


def build(out_dir: Path, size: str, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Writes the checkpoint; returns its parameter counts and the seconds each stage took."""
    started = time.perf_counter()
    build_tiny_model("qwen2_5_vl", out_dir, seed=seed)  # tokenizer, processors, template, generation config
    (out_dir / "model.safetensors").unlink()
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    sizes = SIZES[size]
    base = FAMILIES["qwen2_5_vl"]
    spec = dataclasses.replace(
        base,
        text=sizes["text"],
        vision={**sizes["vision"], "hidden_act": "silu"},
        rope_parameters={**base.rope_parameters, "mrope_section": sizes["mrope_section"]},
    )
    config = _build_config(spec, tokenizer)
    config.dtype = dtype
    with torch.device(device):
        model = base.model_class._from_config(config, dtype=dtype)
    built = time.perf_counter()
    _init(model, seed, device, silent=set(silent_token_ids(tokenizer)), num_ids=len(tokenizer))
    model.generation_config = GenerationConfig.from_pretrained(out_dir)
    initialised = time.perf_counter()
    model.save_pretrained(out_dir, max_shard_size="4GB")
    saved = time.perf_counter()
    counts = _parameter_counts(model)
    info = {
        **counts,
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "construct_s": round(built - started, 1),
        "init_s": round(initialised - built, 1),
        "save_s": round(saved - initialised, 1),
    }
    (out_dir / "bench_checkpoint.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


@torch.no_grad()
def _init(model: torch.nn.Module, seed: int, device: str, silent: set[int], num_ids: int) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("bias"):
            param.zero_()
        elif "embed_tokens" in name or "pos_embed" in name:
            param.normal_(0.0, 1.0, generator=gen)
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, param[0].numel() ** -0.5, generator=gen)
    head = model.get_parameter("lm_head.weight")
    head[num_ids:] = 0.0
    head[sorted(silent)] = 0.0


def _parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters by part, and the weight bytes one decode step reads (the text model's layers, its
    final norm and the LM head: not the vision tower, not the embedding table beyond the batch's rows)."""
    counts = {"vision": 0, "embedding": 0, "decode": 0}
    decode_bytes = 0
    for name, param in model.named_parameters():
        if ".visual." in f".{name}":
            counts["vision"] += param.numel()
        elif "embed_tokens" in name:
            counts["embedding"] += param.numel()
        else:
            counts["decode"] += param.numel()
            decode_bytes += param.numel() * param.element_size()
    return {
        "vision_params": counts["vision"],
        "embedding_params": counts["embedding"],
        "decode_params": counts["decode"],
        "decode_weight_bytes": decode_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    info = build(args.out_dir, args.size, args.device, getattr(torch, args.dtype))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
