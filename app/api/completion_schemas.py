"""OpenAI's legacy completions request (``POST /v1/completions``), as vLLM accepts it: a prompt given as
text or token ids, or a batch of them, continued as it is (no chat template, no media), with the
sampling fields chat has (app/api/sampling_schemas.py) and the completions' own: ``echo``, ``logprobs``
as a count, ``suffix`` (refused), ``add_special_tokens`` (docs/api.md, "Completions")."""

from __future__ import annotations

from typing import Any, cast

from pydantic import Field, StrictInt, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from app.api.sampling_schemas import INT64_MAX, SamplingRequest, null_is_default

MAX_PROMPTS = 64  # prompts of one batch request
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's limit is 5; vLLM's default max_logprobs is 20)
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's for completions
# fields of chat's request that mean nothing for a prompt: refused unless null, not ignored
CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "mm_processor_kwargs",
)

Prompt = str | list[int]


class CompletionRequest(SamplingRequest):
    # (strict: a bool or a float is no token id, nor a count: chat's "logprobs": false is not 0)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # 0 with ``echo``: the prompt alone, scored (with ``logprobs``, its tokens' logprobs), as vLLM's
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    suffix: None = None  # text after the insertion point: these models do not fill in the middle
    prompt_embeds: None = None  # vLLM's embeddings as the prompt: not supported

    @model_validator(mode="before")
    @classmethod
    def _no_chat_fields(cls, body: Any) -> Any:
        if isinstance(body, dict):
            errors: list[InitErrorDetails] = [
                {
                    "type": PydanticCustomError(
                        "chat_field", f"{name} is a chat field: use /v1/chat/completions, or leave it out"
                    ),
                    "loc": (name,),
                    "input": body[name],
                }
                for name in CHAT_ONLY
                if body.get(name) is not None
            ]
            if errors:
                raise ValidationError.from_exception_data("CompletionRequest", errors)
            return {key: value for key, value in body.items() if key not in CHAT_ONLY}  # (nulls)
        return body

    _null_is_default = field_validator("echo", "add_special_tokens", mode="before")(
        classmethod(null_is_default)
    )

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        prompts = [prompt] if isinstance(prompt, str) or _token_ids(prompt) else prompt
        if not prompts or not all(prompts):  # ([] is no prompt, [[]] an empty one)
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
        if any(not 0 <= token_id <= INT64_MAX for p in prompts if isinstance(p, list) for token_id in p):
            raise ValueError("a prompt's token ids must be non-negative integers")
        return prompt

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.echo_only and self.logprob_token_ids:  # (the prompt's positions have their top ones)
            no_positions: InitErrorDetails = {
                "type": PydanticCustomError(
                    "no_positions", "logprob_token_ids needs generated tokens: max_tokens 0 has none"
                ),
                "loc": ("logprob_token_ids",),
                "input": self.logprob_token_ids,
            }
            raise ValidationError.from_exception_data("CompletionRequest", [no_positions])
        if self.max_tokens == 0 and not self.echo:
            error: InitErrorDetails = {
                "type": PydanticCustomError(
                    "no_tokens", "max_tokens must be at least 1 (0 only with echo, to score the prompt)"
                ),
                "loc": ("max_tokens",),
                "input": 0,
            }
            raise ValidationError.from_exception_data("CompletionRequest", [error])
        return self

    @property
    def echo_only(self) -> bool:
        """``max_tokens`` 0 with ``echo``: the answer is the prompt alone (the engine samples one token,
        which is dropped: its prompt logprobs come with its first)."""
        return self.echo and self.max_tokens == 0 and self.max_completion_tokens is None

    @field_validator("suffix", "prompt_embeds", mode="before")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        if value is not None:
            suffix = info.field_name == "suffix"
            why = "these models do not fill in text" if suffix else "give text or token ids"
            raise ValueError(f"{info.field_name} is not supported: {why}")
        return value

    def prompts(self) -> list[Prompt]:
        """Each prompt of the request, in order (one, or a batch's)."""
        prompt = self.prompt
        if isinstance(prompt, str) or _token_ids(prompt):
            return [cast(Prompt, prompt)]
        return cast(list[Prompt], list(prompt))

    def effective_max_tokens(self) -> int | None:
        """The max tokens; 16 where left out (OpenAI's default for completions, and vLLM's)."""
        given = super().effective_max_tokens()
        return DEFAULT_MAX_TOKENS if given is None else max(given, 1)  # (0: echo_only)

    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``, and with ``echo`` and ``logprobs`` the prompt's too: as many
        alternatives as the two ask for at most."""
        echoed = self.logprobs if self.echo else None
        asked = [count for count in (self.prompt_logprobs, echoed) if count is not None]
        return max(asked) if asked else None


def _token_ids(prompt: Any) -> bool:
    """Whether ``prompt`` (a validated prompt field) is one prompt of token ids: a non-empty list of ints."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
