"""Bounds checked while a message decodes (wire/protocol.py): a value out of them makes the message a bad
one (wire/bad_messages.py), never an error deep in the receiver."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 256  # ids whose logprobs a request asks for at each position
