"""The request fields every generating endpoint shares, chat completions (app/api/schemas.py) and
completions (app/api/completion_schemas.py): the model, streaming, the max tokens and the sampling
fields, stop conditions and bad words, the cache salt, an output constraint, what the answer carries
beside its text (prompt logprobs, token ids, named ids' logprobs), the prompt's truncation and the
request's priority, as OpenAI and vLLM define them, validated at the HTTP edge. ``app.api.sampling``
turns them into the engine's ``SamplingParams``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from app.api.constraint_schemas import ResponseFormat, StructuredOutputs
from app.api.request_fields import drop_known_fields
from wire.protocol import MAX_LOGPROB_TOKEN_IDS, MAX_TOP_LOGPROBS

# Integers that travel to the engine must fit its wire format and torch (a seed is a torch.long, as in vLLM).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16  # choices per request (docs/api.md, "Several choices")
MAX_TOKEN_ID_LISTS = 4096  # entries of logit_bias, allowed_token_ids or stop_token_ids
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 1024
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256


class RequestModel(BaseModel):
    """Keeps a field it does not declare in ``model_extra``, read by nothing but the log of unknown
    fields (``app.api.request_fields``)."""

    model_config = ConfigDict(extra="allow")


def null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A before-validator: clients often send an explicit null for "use the default"."""
    return cls.model_fields[info.field_name or ""].default if value is None else value


class StreamOptions(BaseModel):
    """OpenAI's keys; another is refused by name (a misspelt ``include_usage`` would drop the usage)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI pads chunks against side channels; mmserve sends none
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk


class StreamUsage(Enum):
    """Where a stream carries usage: nowhere, in a last chunk of its own (every other chunk saying
    ``usage: null``, as OpenAI's), or also in every chunk as it stands then (vLLM's continuous stats)."""

    NONE = "none"
    LAST = "last"
    CONTINUOUS = "continuous"


class SamplingRequest(RequestModel):
    """The shared fields; an endpoint's request adds its input and its logprobs. The fields OpenAI or vLLM
    define that no request declares are sorted out before validation (``app.api.request_fields``), and
    unknown ones land in ``model_extra``."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # None: the model's default (its generation_config.json, docs/configuration.md), else vLLM's
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] | None = Field(None, max_length=4)  # a single string is read as a one-item list
    n: int = Field(1, ge=1, le=MAX_N)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # token id (as a string, OpenAI's shape) -> bias; ids outside the vocabulary are refused by the service
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_TOKEN_ID_LISTS)
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1 and 0 mean off; None: the model's default
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=1e6)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_ID_LISTS)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_TOKEN_ID_LISTS)
    # words the answer may not contain, as token sequences (app/api/sampling.py: bad_words_token_ids)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    # vLLM's: requests with different salts share no cache hit of any kind (docs/api.md, "Cache salts")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, strict=True)
    # structured outputs (docs/api.md): OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: each prompt token's logprob and its position's most likely tokens (app/api/prompt_logprobs.py)
    prompt_logprobs: int | None = Field(None, strict=True)
    # vLLM's: the prompt's token ids and each choice's in the response; logprobs' tokens as "token_id:<id>"
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: the request's place under --scheduling-policy priority (lower first); 0 under fcfs
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX, strict=True)
    # vLLM's: the prompt cut to its last (``truncation_side`` right: first) this many tokens; -1: as many
    # as leave room for the max tokens (app/api/sampling.py: prompt_truncation)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX, strict=True)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: with logprobs, these ids' logprobs at each generated position in place of the top ones
    logprob_token_ids: list[int] | None = Field(None, max_length=MAX_LOGPROB_TOKEN_IDS)

    @model_validator(mode="before")
    @classmethod
    def _sort_fields(cls, body: Any) -> Any:
        return drop_known_fields(body, cls.model_fields)

    _null_is_default = field_validator(
        "stream", "n", "frequency_penalty", "presence_penalty", "ignore_eos", "min_tokens",
        "include_stop_str_in_output", "skip_special_tokens", "return_token_ids", "priority",
        "return_tokens_as_token_ids", mode="before",
    )(classmethod(null_is_default))  # fmt: skip

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        stop = [stop] if isinstance(stop, str) else stop
        if isinstance(stop, list) and "" in stop:
            raise ValueError("stop strings must not be empty")
        return stop or None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be from -100 to 100, got {value} for {key}")
        return bias or None

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, token_ids: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if token_ids is not None and not all(0 <= t <= INT64_MAX for t in token_ids):
            raise ValueError(f"{info.field_name} must be token ids (non-negative integers)")
        return token_ids

    @field_validator("bad_words")
    @classmethod
    def _words(cls, words: list[str] | None) -> list[str] | None:
        for word in words or ():
            if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(
                    f"bad words must be 1 to {MAX_BAD_WORD_CHARS} characters, not all whitespace"
                )
        return words or None

    @field_validator("logprob_token_ids")
    @classmethod
    def _named_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and not all(0 <= t <= INT64_MAX for t in ids):
            raise ValueError("logprob_token_ids must be token ids (non-negative integers)")
        return list(dict.fromkeys(ids)) if ids else None  # ([]: the top ones, as vLLM's)

    @model_validator(mode="after")
    def _named_ids_with_logprobs(self) -> Any:
        if self.logprob_token_ids and self.num_top_logprobs() is None:
            error: InitErrorDetails = {
                "type": PydanticCustomError("needs_logprobs", "logprob_token_ids needs logprobs"),
                "loc": ("logprob_token_ids",),
                "input": self.logprob_token_ids,
            }
            raise ValidationError.from_exception_data(type(self).__name__, [error])
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: as many as fit)")
        return keep

    @field_validator("request_id")
    @classmethod
    def _printable(cls, request_id: str | None) -> str | None:
        if request_id is not None and not request_id.isprintable():
            raise ValueError("request_id must be printable characters")
        return request_id

    # The checks below read fields declared earlier (``info.data``), so each error names its field.
    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be from 0 to {MAX_TOP_LOGPROBS} (-1, the whole vocabulary, is not "
                "supported)"
            )
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream", True):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("min_tokens")
    @classmethod
    def _within_max_tokens(cls, min_tokens: int, info: ValidationInfo) -> int:
        limits = [info.data.get("max_completion_tokens"), info.data.get("max_tokens")]
        max_tokens = next((limit for limit in limits if limit is not None), None)
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({min_tokens}) must not exceed the max tokens ({max_tokens})")
        return min_tokens

    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` over ``max_tokens``; None means up to the context limit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        """``SamplingParams.num_prompt_logprobs`` of the first choice (the others echo its)."""
        return self.prompt_logprobs

    def num_top_logprobs(self) -> int | None:
        """``SamplingParams.num_top_logprobs``: None without logprobs, else alternatives per token (an
        endpoint's request that has logprobs says how many)."""
        return None

    @property
    def stream_usage(self) -> StreamUsage:
        """Where a stream carries usage (non-streamed responses always carry it)."""
        options = self.stream_options
        if options is None or not options.include_usage:
            return StreamUsage.NONE  # (continuous_usage_stats alone changes nothing, as in vLLM)
        return StreamUsage.CONTINUOUS if options.continuous_usage_stats else StreamUsage.LAST
