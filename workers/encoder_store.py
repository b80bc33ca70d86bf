"""The worker's half of the encoder cache: encoder outputs by mm_hash.

The engine's encoder cache manager decides what is stored and when it is dropped; this store only
obeys. Invariants:
- an entry is added exactly when the scheduler sent the item as an ``EncoderInput``;
- an entry is removed exactly when its mm_hash arrives in ``SchedulerOutput.free_mm_hashes``;
- a lookup of a missing entry is an engine/worker disagreement and raises ``MissingEncoderOutput``,
  never a silent re-encode.
"""

from __future__ import annotations

import torch


class MissingEncoderOutput(LookupError):
    """A scheduled token needs an encoder output the store does not hold."""


class EncoderStore:
    def __init__(self) -> None:
        self._outputs: dict[str, torch.Tensor] = {}

    def put(self, mm_hash: str, output: torch.Tensor) -> None:
        """Called after the encoder ran on the item; ``output`` is [num_tokens, text_hidden]."""
        self._outputs[mm_hash] = output

    def get(self, mm_hash: str) -> torch.Tensor:
        try:
            return self._outputs[mm_hash]
        except KeyError:
            raise MissingEncoderOutput(
                f"encoder output for mm_hash {mm_hash!r} is not in the store"
            ) from None

    def free(self, mm_hashes: list[str]) -> None:
        """Called at the start of a step with the scheduler's ``free_mm_hashes``. Unknown keys are
        ignored: the scheduler may free an entry whose encode never reached this worker (aborted)."""
        for mm_hash in mm_hashes:
            self._outputs.pop(mm_hash, None)

    def clear(self) -> None:
        self._outputs.clear()

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._outputs

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def num_tokens(self) -> int:
        """Embeddings held, in the unit the engine's budget counts."""
        return sum(out.shape[0] for out in self._outputs.values())
