"""The gateway's one error type: :class:`APIError` is answered with its status and OpenAI's error JSON
(``{"error": {message, type, param, code}}``), and the constructors of the errors many places raise."""
from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """An error answered with ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, available: list[str]) -> APIError:
    return APIError(404, f"The model '{model}' does not exist. Available models: {', '.join(available)}",
                    param="model", code="model_not_found")


def context_overflow(max_len: int, prompt_tokens: int, max_tokens: int | None) -> APIError:
    asks = f" and asks for {max_tokens} more" if max_tokens is not None else ""
    return APIError(400, f"This model's maximum context length is {max_len} tokens; the request has "
                         f"{prompt_tokens} prompt tokens{asks}. Shorten the prompt or lower max_tokens.",
                    param="messages", code="context_length_exceeded")
