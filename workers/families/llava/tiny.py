"""Build the tiny, randomly initialised LLaVA-1.5 checkpoint that tests and `make serve` run on.

The folder looks like a real `llava-hf/llava-1.5-*` checkpoint to transformers: `LlavaConfig` with a CLIP
vision tower and a Llama LM, a `LlavaProcessor` (CLIP image processor + fast tokenizer + chat template),
fp32 safetensors and a generation config. Only the sizes are tiny (~1M parameters); the vision geometry is
the real one (336px, patch 14 → 576 image tokens per image), so placeholder expansion, encoder-cache
accounting and KV sizing are exercised exactly as with the 7B model. Everything is generated locally and
deterministically from `seed`: no hub, no downloads.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import processors
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from workers.families.tiny_common import (
    construct,
    init_weights,
    silent_token_ids,
    train_byte_level_bpe,
    write_checkpoint,
)

IMAGE_SIZE_PX = 336
PATCH_SIZE_PX = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE_PX // PATCH_SIZE_PX) ** 2  # 576; the CLS token is dropped ("default")
BPE_VOCAB_SIZE = 2048  # byte-level BPE including the three trained-in specials; two more are added after

# Why these gains (see tiny_common.init_weights for the rest): with the usual N(0, 0.02) a model this
# narrow shrinks activations layer by layer, attention stays uniform, and the last position sees the
# *average* of 576 image tokens, nearly the same for any two images, so greedy decoding falls into one
# repeated token whatever the image. q_proj and k_proj ×2 (attention logits ×4) make attention pick out a
# few image patches; lm_head ×6 gives logits of std ≈ 6, a mildly peaked distribution (median top-1
# probability ≈ 0.5, median top-1/top-2 gap ≈ 1 logit), so fp32 kernel noise (~1e-5) practically never
# flips a greedy choice. Measured with seeds 0-3 and one prompt: 8 noise, 8 solid-colour and 8 shape
# images each give 8/8 distinct 16-token greedy outputs (12/12 for smooth blob images), ~14 different
# tokens per output, and eager and sdpa attention agree on every token.
GAINS = {"q_proj": 2.0, "k_proj": 2.0, "lm_head": 6.0}
EMBEDDINGS = ("class_embedding", "embed_tokens", "position_embedding")

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"

# llava-1.5 ("vicuna v1") conversation shape: "USER: <image>\n{text} ASSISTANT: {answer}</s>USER: ...".
# Content is a plain string or an OpenAI-like part list rendered in order; "image" and "image_url" parts
# both become one <image> placeholder, which the processor then expands to 576 image tokens. The tokenizer
# prepends <s>, so the template does not.
RENDER_MACRO = r"""
{%- macro render(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none -%}
        {%- for part in content -%}
            {%- if part['type'] in ['image', 'image_url'] -%}
                {{- '<image>\n' -}}
            {%- elif part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""
# the template of the tiny LLaVA (and of a template built on it, tests/llava_tool_template.py)
CHAT_TEMPLATE = (
    RENDER_MACRO
    + r"""{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {{- render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'user' -%}
        {{- 'USER: ' + render(message['content']) + ' ' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- 'ASSISTANT: ' + render(message['content']) + '</s>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""
)


def build_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint into `out_dir` and return its path; takes a few seconds on a CPU.

    Same `seed` ⇒ bit-identical files; the seed changes the weights only (the tokenizer is fixed). An
    existing checkpoint folder is replaced (built beside it, then swapped in); a non-empty folder that is
    not a checkpoint (no config.json) is refused rather than deleted.
    """
    return write_checkpoint(out_dir, lambda folder: _write(folder, seed))


def _write(out_path: Path, seed: int) -> None:
    tokenizer = _build_tokenizer()
    image_processor = CLIPImageProcessorPil(  # CLIP's resample/mean/std defaults are llava-1.5's
        size={"shortest_edge": IMAGE_SIZE_PX},
        crop_size={"height": IMAGE_SIZE_PX, "width": IMAGE_SIZE_PX},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE_PX,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped again by "default"
        image_token=IMAGE,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_path)

    model = construct(LlavaForConditionalGeneration, _build_config(tokenizer))
    init_weights(
        model, seed, gains=GAINS, embeddings=EMBEDDINGS, silent_token_ids=silent_token_ids(tokenizer)
    )
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_path)


def _build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) with Llama's <s>-prepending behaviour; like llava-hf, <image> and
    <pad> come after the trained vocabulary."""
    tok = train_byte_level_bpe(BPE_VOCAB_SIZE, trained_specials=[UNK, BOS, EOS], added_specials=[IMAGE, PAD])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},
        padding_side="left",
        model_max_length=4096,
    )


def _build_config(tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    vision_config = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE_PX,
        patch_size=PATCH_SIZE_PX,
        hidden_act="quick_gelu",
    )
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=tokenizer.get_vocab()[IMAGE],
        image_seq_length=NUM_IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        dtype="float32",
    )
