"""Errors that carry an HTTP status and a stable code.

Handlers and domain modules raise these; the one `try` in `localrt.app`
turns them into the JSON error body. Nothing else builds error responses.
"""

from __future__ import annotations


class HTTPError(Exception):
    """An error with an HTTP status, an OpenAI-style type and a stable code."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers=None,
                 extra: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = list(headers or [])
        self.extra = dict(extra or {})  # more top-level fields, e.g. the taskId of a 409

    def body(self) -> dict:
        """The JSON error body: `message` for curl users, `error` for OpenAI clients."""
        error = {"message": self.message, "type": self.type, "code": self.code}
        if self.param is not None:
            error["param"] = self.param
        return {**self.extra, "message": self.message, "error": error}


class BadRequest(HTTPError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidField(BadRequest):
    """A request field has the wrong type, shape or value."""

    code = "invalid_field"


class InvalidImage(InvalidField):
    """An image part whose bytes llama.cpp cannot read, or a malformed data URL; the
    message and `param` name the part (messages[0].content[1])."""

    code = "invalid_image"


class ImagesNotSupported(BadRequest):
    """A request with images for a model that has no projector (mmproj)."""

    code = "images_not_supported"


class InvalidAudio(InvalidField):
    """An audio part whose bytes are not a WAV, MP3 or FLAC llama.cpp's mtmd decodes, or
    a malformed one; the message and `param` name the part."""

    code = "invalid_audio"


class AudioTooLong(InvalidField):
    """A clip longer than maxAudioSeconds; the message names the part and the limit."""

    code = "audio_too_long"


class AudioNotSupported(BadRequest):
    """A request with audio for a model without an audio projector (a vision-only one,
    an ONNX model)."""

    code = "audio_not_supported"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class InvalidModelFile(BadRequest):
    """A model file llama.cpp must not load: its header breaks a rule (the message names
    it), or a child process that loaded it first failed or crashed (issue 38)."""

    code = "invalid_model_file"


class InvalidChatTemplate(BadRequest):
    """A model's chat template that failed to render, took too long, rendered too much
    or reached for Python's internals; the message names the model."""

    code = "invalid_chat_template"


class Unauthorized(HTTPError):
    """No API key, or a wrong one, where the server requires one."""

    status = 401
    type = "authentication_error"
    code = "unauthorized"


class Forbidden(HTTPError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(HTTPError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class MethodNotAllowed(HTTPError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, allowed):
        super().__init__(message, headers=[("Allow", ", ".join(allowed))])
        self.allowed = tuple(allowed)


class Conflict(HTTPError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class ModelFileMissing(Conflict):
    """A registered model whose file was deleted or truncated behind localrt's back; the
    message names the path and says to pull or import it again."""

    code = "model_file_missing"


class PayloadTooLarge(HTTPError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class ImageTooLarge(PayloadTooLarge):
    """One image of more than the 20 MiB a request may carry (localrt.inference.media)."""

    code = "image_too_large"


class AudioTooLarge(PayloadTooLarge):
    """One clip of more than the 25 MiB a request may carry (localrt.inference.media)."""

    code = "audio_too_large"


class UnsupportedMediaType(HTTPError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class UpstreamError(HTTPError):
    """A hub, CDN or proxy failed us; the message says which and why."""

    status = 502
    type = "server_error"
    code = "upstream_error"


class InsufficientStorage(HTTPError):
    """localrt could not write its own files (disk full, read-only, permissions)."""

    status = 507
    type = "server_error"
    code = "storage_error"


class DiskFull(InsufficientStorage):
    """No space left on the device for a file localrt writes; the message names the
    folder and how much more is needed."""

    code = "insufficient_storage"


class ServiceUnavailable(HTTPError):
    status = 503
    type = "server_error"
    code = "unavailable"


class InsufficientMemory(ServiceUnavailable):
    """A model start this machine cannot hold: its weights, KV cache and compute buffers
    need more than the free RAM (and GPU memory); the message gives both in MiB and
    what to change (localrt.engines.memory)."""

    code = "insufficient_memory"


class InternalError(HTTPError):
    """What a client sees for an unexpected exception; the traceback stays in the log."""

    status = 500
    type = "server_error"
    code = "internal_error"


SHOWN = 64  # characters of a bad value an error message quotes


def shown(value, limit: int = SHOWN) -> str:
    """A value as an error message quotes it: its repr, cut to `limit` characters and
    marked "…" when longer, so a message never carries a hostile value whole."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
