"""Typed errors of the API process.

Code inside the API raises these; one place (the HTTP layer) maps them to the OpenAI error envelope
``{"error": {"message", "type", "param", "code"}}`` with ``http_status``. Nothing here knows about FastAPI.
"""

from __future__ import annotations

from workers.families.errors import FamilyInputError

MM_PROCESSOR_KWARGS = "mm_processor_kwargs"
INVALID_MM_PROCESSOR_KWARGS = "invalid_mm_processor_kwargs"  # an option the processor cannot take


class MMServeError(Exception):
    """Base of every error that reaches the client with an OpenAI-shaped body."""

    http_status: int = 500
    err_type: str = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, code={self.code!r})"


class InvalidRequestError(MMServeError):
    """The request is malformed or asks for something this server cannot do (400)."""

    http_status = 400
    err_type = "invalid_request_error"


class MediaError(InvalidRequestError):
    """An image or a video could not be fetched, decoded or accepted (400, never a 500).

    Codes: ``invalid_image_url`` (bad scheme, host or data URL), ``image_url_forbidden`` (refused by the
    media policy: a non-public address, a host outside ``--allowed-media-domains``, ``file://`` outside
    ``--allowed-local-media-path``), ``too_many_redirects`` (over ``--max-media-redirects``),
    ``image_fetch_failed`` (HTTP error, timeout, connection refused, unknown host), ``image_too_large``
    (encoded bytes or pixels over the limit), ``request_images_too_large`` (all images of the request
    over ``--max-request-image-bytes``; param ``messages``), ``invalid_image`` (bytes that do not decode,
    or a format outside the decoded ones), ``unsupported_image_format`` (SVG, HEIC/HEIF, AVIF).

    Video codes (``app.media.video``): ``invalid_video`` (not a video, or bytes FFmpeg cannot read or
    decode), ``video_is_an_image`` (PNG, JPEG, GIF, BMP, TIFF, WebP, HEIF/AVIF sent as a video, animated
    or not), ``unsupported_video_format`` (a container other than MP4/MOV and WebM/Matroska: AVI, FLV,
    MPEG-TS...), ``unsupported_video_codec`` (other than H.264, HEVC, VP8, VP9, AV1, or not
    decodable here), ``video_stream_missing`` (audio only), ``video_empty`` (no frames),
    ``video_dimensions_too_large`` (frame pixels over the limit), ``video_too_long`` (frames or duration
    over the limits), ``video_variable_frame_rate``, ``video_rotated`` (a display matrix that rotates or
    mirrors), ``video_truncated`` (the file ends before what its header declares, or before a wanted
    frame), ``video_decode_timeout`` (probe or decode over its time budget).
    """

    default_code = "invalid_image"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (404, as OpenAI answers)."""

    http_status = 404
    default_code = "model_not_found"

    def __init__(self, message: str, *, param: str | None = "model", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context (400)."""

    default_code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = "messages", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class NotFoundError(InvalidRequestError):
    """A stored object (a response) that does not exist for this API key: never stored, evicted,
    deleted, or another key's (404)."""

    http_status = 404
    default_code = "not_found"


class AuthenticationError(MMServeError):
    """Missing or wrong ``Authorization: Bearer <key>`` on a guarded route (401, as OpenAI answers)."""

    http_status = 401
    err_type = "invalid_request_error"
    default_code = "invalid_api_key"


class RequestTooLargeError(MMServeError):
    """The request body is larger than ``--max-request-body-mb`` (413); refused before it is read."""

    http_status = 413
    err_type = "invalid_request_error"
    default_code = "request_too_large"


class UnsupportedMediaTypeError(MMServeError):
    """The request body is sent with a ``Content-Encoding`` the server does not read (415)."""

    http_status = 415
    err_type = "invalid_request_error"
    default_code = "unsupported_content_encoding"


class TooManyRequestsError(MMServeError):
    """The engine's waiting queue is full (429 with ``Retry-After``); nothing already accepted is dropped."""

    http_status = 429
    err_type = "rate_limit_error"
    default_code = "too_many_requests"
    retry_after_s = 1


class EngineUnavailableError(MMServeError):
    """The engine is not ready, died or was restarted under the request, or the server is draining
    (503; codes ``engine_unavailable``, ``worker_unavailable``, ``server_shutting_down``)."""

    http_status = 503
    err_type = "server_error"
    default_code = "engine_unavailable"


class InternalError(MMServeError):
    """The model failed while running the request (500); other requests are not affected."""

    http_status = 500
    err_type = "server_error"


def from_family_error(exc: FamilyInputError) -> InvalidRequestError:
    """The 400 a model family's refusal becomes (the families raise their own type: they live below the
    API process). One naming ``mm_processor_kwargs`` without a code of its own is
    ``invalid_mm_processor_kwargs``."""
    code = exc.code
    if code is None and (exc.param or "").startswith(MM_PROCESSOR_KWARGS):
        code = INVALID_MM_PROCESSOR_KWARGS
    return InvalidRequestError(exc.message, param=exc.param, code=code)
