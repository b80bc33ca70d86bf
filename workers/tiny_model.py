"""Build the tiny, randomly initialised LLaVA-1.5 checkpoint that tests and `make serve` run on.

The folder looks like a real `llava-hf/llava-1.5-*` checkpoint to transformers: `LlavaConfig` with a CLIP
vision tower and a Llama LM, a `LlavaProcessor` (CLIP image processor + fast tokenizer + chat template),
fp32 safetensors and a generation config. Only the sizes are tiny (~1M parameters); the vision geometry is
the real one (336px, patch 14 → 576 image tokens per image), so placeholder expansion, encoder-cache
accounting and KV sizing are exercised exactly as with the 7B model. Everything is generated locally and
deterministically from `seed`: no hub, no downloads.
"""

from __future__ import annotations

import random
import shutil
import string
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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

IMAGE_SIZE_PX = 336
PATCH_SIZE_PX = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE_PX // PATCH_SIZE_PX) ** 2  # 576; the CLS token is dropped ("default")
BPE_VOCAB_SIZE = 2048  # byte-level BPE including the three trained-in specials; two more are added after

ATTENTION_QK_GAIN = 2.0  # see _init_weights
LM_HEAD_GAIN = 6.0

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"

# llava-1.5 ("vicuna v1") conversation shape: "USER: <image>\n{text} ASSISTANT: {answer}</s>USER: ...".
# Content is a plain string or an OpenAI-like part list rendered in order; "image" and "image_url" parts
# both become one <image> placeholder, which the processor then expands to 576 image tokens. The tokenizer
# prepends <s>, so the template does not.
CHAT_TEMPLATE = r"""
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
{%- for message in messages -%}
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

# The tokenizer's training corpus: fixed (not seeded by the caller), so every seed shares one tokenizer.
_CORPUS_SEED = 0
_WORDS = (
    "the a an of to in and is are was were be been it this that these those with for on at by from as "
    "image picture photo shows show there here what which who where when why how color colour red green "
    "blue yellow black white orange purple pink brown gray grey dark light bright small large big tiny "
    "left right top bottom middle center corner background foreground person people man woman child dog "
    "cat bird car bus train tree house street sky cloud sun water sea river mountain road table chair "
    "book cup plate food window door wall floor screen text number line circle square shape pattern "
    "noise stripe describe answer question please tell me you we they he she can could would should will "
    "not no yes one two three four five many some all each every very more most less USER ASSISTANT "
    "system model vision language token server request response cache hash encoder decoder batch"
)
_SYLLABLES = "ka ri to mu ne sa lo vi pe du ga ze ho fi ba ny qu tr st ch sh th pl gr bl ou ea io"


def build_tiny_llava(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint into `out_dir` and return its path; takes a few seconds on a CPU.

    Same `seed` ⇒ bit-identical files; the seed changes the weights only (the tokenizer is fixed). An
    existing checkpoint folder is replaced (built beside it, then swapped in); a non-empty folder that is
    not a checkpoint (no config.json) is refused rather than deleted.
    """
    out_path = Path(out_dir)
    if out_path.exists() and any(out_path.iterdir()) and not (out_path / "config.json").exists():
        raise FileExistsError(f"{out_path} is not empty and holds no checkpoint; refusing to replace it")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        _write_checkpoint(staging, seed)
        for path in (staging, *staging.iterdir()):  # mkdtemp (and the safetensors writer) make them private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_path.exists():
            shutil.rmtree(out_path)
        staging.rename(out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def _write_checkpoint(out_path: Path, seed: int) -> None:
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

    with torch.random.fork_rng(devices=[]):  # the constructor's throwaway init must not touch the global RNG
        model = LlavaForConditionalGeneration(_build_config(tokenizer))
    _init_weights(model, seed, silent_token_ids=_silent_token_ids(tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_path)


def _corpus() -> list[str]:
    """Deterministic pseudo-English sentences: enough distinct words for ~2k BPE merges."""
    rng = random.Random(_CORPUS_SEED)
    syllables = _SYLLABLES.split()
    made_up = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(600)]
    vocab = _WORDS.split() + made_up
    lines = []
    for _ in range(4000):
        words = [rng.choice(vocab) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":", "\n"]))
    return lines


def _build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style, so every string round-trips) with Llama's <s>-prepending behaviour."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Like llava-hf: <image> and <pad> are added after the trained vocabulary.
    tok.add_special_tokens([IMAGE, PAD])
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


def _silent_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids the model should never emit: the special tokens, and single bytes that are not printable ASCII.

    Without specials the output never stops early (<eos>) or carries placeholders (<image>); without stray
    bytes it is always readable text (the corpus is ASCII, so every multi-byte merge is printable anyway).
    """
    printable = set(string.printable) - set("\r\x0b\x0c")
    special_ids = set(tokenizer.all_special_ids)
    return [
        token_id
        for token_id in range(len(tokenizer))
        if token_id in special_ids or not set(tokenizer.decode([token_id])) <= printable
    ]


def _init_weights(model: LlavaForConditionalGeneration, seed: int, silent_token_ids: list[int]) -> None:
    """Overwrite every parameter so that the random model's greedy output depends on the image.

    Why not the usual N(0, 0.02): in a model this narrow, 0.02 shrinks activations layer by layer, attention
    stays uniform, and the last position sees the *average* of 576 image tokens, which is nearly the same for
    any two images; greedy decoding then falls into one repeated token whatever the image. Instead:

    - weights of linears/convs ~ N(0, 1/fan_in): variance-preserving, activations stay O(1);
    - q_proj and k_proj ×2 (attention logits ×4): attention picks out a few image patches rather than
      averaging them, so different images (noise with different seeds, colours, shapes) steer decoding;
    - token, CLIP class and position embeddings ~ N(0, 1): on the scale of the hidden states;
    - lm_head ×6: logits of std ≈ 6, a mildly peaked distribution (median top-1 probability ≈ 0.5, median
      top-1/top-2 gap ≈ 1 logit), so fp32 kernel noise (~1e-5) practically never flips a greedy choice;
    - lm_head rows of `silent_token_ids` zeroed: their logit is 0 while the best logit is ≈ +15, so greedy
      decoding never picks them and sampling practically never does. Generation runs to max_tokens and
      the text is printable ASCII;
    - norm weights 1, biases 0.

    Measured with seeds 0-3 and one prompt: 8 noise, 8 solid-colour and 8 shape images each give 8/8
    distinct 16-token greedy outputs (12/12 for smooth blob images), ~14 different tokens per output, and
    eager and sdpa attention agree on every token. A local generator keeps the global RNG untouched.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif name.endswith("class_embedding") or "embed_tokens" in name or "position_embedding" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:  # LayerNorm / RMSNorm weights
                param.fill_(1.0)
            else:
                gain = 1.0
                if "q_proj" in name or "k_proj" in name:
                    gain = ATTENTION_QK_GAIN
                elif name.startswith("lm_head"):
                    gain = LM_HEAD_GAIN
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=gen) * (gain / fan_in**0.5))
        model.lm_head.weight[silent_token_ids] = 0.0
