"""The edge of the engine's API socket: a multipart message from an API process becomes a typed
message, or ``BadMessage`` (wire/bad_messages.py) before anything is applied.

    [identity] [frame 0: msgpack message] [frame 1..n: tensor bytes of an AddRequest]

Checked here, beyond what decoding checks (types and bounds in wire/protocol.py): only an
``AddRequest`` carries tensor frames, and then exactly those its features reference, each of the size
its dtype and shape give; its placeholders lie inside the prompt, in order, without overlap; its
token ids are below the worker's vocabulary. A request id already held is refused in
``EngineCore.add_request`` (docs/architecture.md, "Bad messages").
"""

from __future__ import annotations

from collections.abc import Sequence

from wire.bad_messages import BadMessage, check_tensor_frames, decode_frame0
from wire.protocol import AddRequest, EngineInbound, TensorRef, decode_engine_inbound


def decode_api_message(frames: Sequence[memoryview]) -> EngineInbound:
    """The message in ``frames`` (the multipart message without the sender's identity); ``BadMessage``
    for anything the engine cannot take whatever its state."""
    msg = decode_frame0(decode_engine_inbound, frames)
    if not isinstance(msg, AddRequest):
        if len(frames) != 1:
            raise BadMessage("extra frame", f"{type(msg).__name__} with {len(frames) - 1} tensor frames")
        return msg
    refs: list[TensorRef] = []
    for feature in msg.mm_features:
        if feature.tensors is not None:
            if feature.shm is not None:
                raise BadMessage("item both framed and in shm", feature.mm_hash, msg.req_id)
            refs.extend(feature.tensors.values())
    check_tensor_frames(refs, frames, msg.req_id)
    _check_placeholders(msg)
    return msg


def _check_placeholders(msg: AddRequest) -> None:
    end = 0
    for feature in msg.mm_features:
        if feature.offset < end:
            where = f"item at {feature.offset} before {end}"
            raise BadMessage("placeholders out of order", where, msg.req_id)
        if feature.num_span_tokens and feature.num_span_tokens < feature.num_tokens:
            raise BadMessage("span shorter than its placeholders", feature.mm_hash, msg.req_id)
        end = feature.end
    if end > len(msg.prompt_token_ids):
        raise BadMessage(
            "placeholders past the prompt", f"{end} > {len(msg.prompt_token_ids)} tokens", msg.req_id
        )


def check_vocab(msg: AddRequest, vocab_size: int) -> None:
    """Every token id of the prompt and of the sampling parameters is below ``vocab_size`` (the
    worker's; 0: not known, nothing checked)."""
    if not vocab_size:
        return
    sampling = msg.sampling
    for where, token_ids in (
        ("prompt", msg.prompt_token_ids),
        ("logit_bias", sampling.logit_bias or ()),
        ("allowed_token_ids", sampling.allowed_token_ids or ()),
        ("stop_token_ids", sampling.stop_token_ids),
        ("bad_words", [t for ids in sampling.bad_words or () for t in ids]),
        ("logprob_token_ids", sampling.logprob_token_ids or ()),
    ):
        largest = max(token_ids, default=-1)
        if largest >= vocab_size:
            detail = f"{where}: {largest} >= vocab size {vocab_size}"
            raise BadMessage("token id out of range", detail, msg.req_id)
