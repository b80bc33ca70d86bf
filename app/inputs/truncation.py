"""vLLM's ``truncate_prompt_tokens`` and ``truncation_side`` (docs/api.md, "Request fields"): the prompt,
as the model reads it (media placeholders expanded), cut to its last (or first) ``keep`` tokens before it
is sent. A cut is only ever through text: one that would split or drop an image or a video is a 400
naming the field (an item's placeholders stand for its encoder output, whole), never a silent change of
what the model sees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from app.errors import InvalidRequestError

if TYPE_CHECKING:  # (the input processor's type; nothing here imports it at run time)
    from app.inputs.input_processor import PreparedRequest

PARAM = "truncate_prompt_tokens"


@dataclass(frozen=True)
class Truncation:
    keep: int  # tokens kept, at least 1
    side: Literal["left", "right"] = "left"  # left: the last ``keep`` are kept (vLLM's default)

    def apply(self, prepared: PreparedRequest) -> bool:
        """Cuts ``prepared``'s prompt (after each ``resolve``, which tokenizes it again: so cutting a
        cut prompt changes nothing); whether it cut. A 400 where the cut would reach into media."""
        ids = prepared.prompt_token_ids
        cut = len(ids) - self.keep
        if cut <= 0:
            return False
        left = self.side == "left"
        if left:
            reached = any(first < cut for first, _ in prepared.spans)
        else:
            reached = any(end > self.keep for _, end in prepared.spans)
        if reached:
            kind = "first" if left else "last"
            raise InvalidRequestError(
                f"{PARAM} {self.keep} would cut into the prompt's media: of its {len(ids)} tokens, the "
                f"{kind} {cut} would go, through an image's or a video's placeholders. Keep more tokens, "
                "or send fewer media.",
                param=PARAM,
                code="invalid_value",
            )
        if left:
            prepared.prompt_token_ids = ids[cut:]
            prepared.spans = [(first - cut, end - cut) for first, end in prepared.spans]
        else:
            prepared.prompt_token_ids = ids[: self.keep]
        return True
