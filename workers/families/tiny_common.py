"""What the tiny-checkpoint builders share: the tokenizer corpus and BPE training, the staging-dir writer,
the "input-sensitive" weight init, and the ids a tiny model must never emit.

Everything here is deterministic: the corpus has a fixed seed, BPE training on it is reproducible, and the
weights come from a local ``torch.Generator`` seeded by the caller, so one seed gives bit-identical files.
"""

from __future__ import annotations

import random
import shutil
import string
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedConfig, PreTrainedModel

ModelT = TypeVar("ModelT", bound=PreTrainedModel)

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


def corpus() -> list[str]:
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


def train_byte_level_bpe(
    vocab_size: int,
    trained_specials: list[str],
    added_specials: list[str],
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
) -> Tokenizer:
    """A byte-level BPE (every string round-trips) trained on ``corpus()``.

    ``trained_specials`` take the first ids (inside ``vocab_size``), ``added_specials`` come after the
    trained vocabulary in the given order, as in the family's real tokenizer. ``pre_tokenizer`` defaults
    to GPT-2's byte-level splitting; the ByteLevel decoder is always used.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=trained_specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens(added_specials)
    return tok


def write_checkpoint(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(folder)`` into a staging folder beside ``out_dir``, then swap it in; return the path.

    An existing checkpoint folder is replaced only once the new one is complete; a non-empty folder that
    is not a checkpoint (no config.json) is refused rather than deleted.
    """
    out_path = Path(out_dir)
    if out_path.exists() and any(out_path.iterdir()) and not (out_path / "config.json").exists():
        raise FileExistsError(f"{out_path} is not empty and holds no checkpoint; refusing to replace it")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        write(staging)
        for path in (staging, *staging.iterdir()):  # mkdtemp (and the safetensors writer) make them private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_path.exists():
            shutil.rmtree(out_path)
        staging.rename(out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def construct(model_class: type[ModelT], config: PreTrainedConfig) -> ModelT:
    """The model from its config; the constructor's throwaway init must not touch the global RNG."""
    with torch.random.fork_rng(devices=[]):
        return model_class(config)


def silent_token_ids(tokenizer: Any) -> list[int]:
    """Ids the model should never emit: special tokens, and single bytes that are not printable ASCII.

    Without specials the output never stops early (EOS) or carries placeholders (image tokens); without
    stray bytes it is always readable text (the corpus is ASCII, so every multi-byte merge is printable).
    """
    printable = set(string.printable) - set("\r\x0b\x0c")
    # Added special tokens without a named role (Qwen's <|im_start|>, <|vision_pad|>, ...) included.
    special_ids = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    return [
        token_id
        for token_id in range(len(tokenizer))
        if token_id in special_ids or not set(tokenizer.decode([token_id])) <= printable
    ]


def init_weights(
    model: torch.nn.Module,
    seed: int,
    *,
    gains: Mapping[str, float],
    embeddings: Iterable[str],
    silent_token_ids: list[int],
    rows_gain: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
) -> None:
    """Overwrite every parameter, in name order, from one generator seeded with ``seed``.

    - biases 0; other 1-D parameters (LayerNorm / RMSNorm weights) 1, or their ``gains`` entry (below);
    - parameters whose name contains one of ``embeddings`` ~ N(0, 1), on the scale of the hidden states;
    - every other weight ~ N(0, gain² / fan_in): variance-preserving at gain 1, so activations stay O(1)
      through a narrow model instead of shrinking as with the usual N(0, 0.02). ``gain`` is the value of
      the first key of ``gains`` contained in the name (1 if none); ``rows_gain(name, param)`` may instead
      return a per-output-row gain (fused q/k/v projections);
    - the lm_head rows of ``silent_token_ids`` zeroed: their logit is 0 while the best one is large, so
      greedy decoding never picks them.

    Why the gains matter is explained where a family picks them (llava/tiny.py, qwen_vl/tiny.py).
    """
    embedding_names = tuple(embeddings)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif any(key in name for key in embedding_names):
                param.copy_(torch.randn(param.shape, generator=gen))
            elif param.dim() == 1:  # norm weights
                param.fill_(next((g for key, g in gains.items() if key in name), 1.0))
            else:
                row_gains = rows_gain(name, param) if rows_gain is not None else None
                gain: float | torch.Tensor = next((g for key, g in gains.items() if key in name), 1.0)
                if row_gains is not None:
                    gain = row_gains.reshape(-1, *([1] * (param.dim() - 1)))
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=gen) * (gain / fan_in**0.5))
        model.get_parameter("lm_head.weight")[silent_token_ids] = 0.0
