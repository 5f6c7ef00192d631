"""One error type for everything the broker refuses, carrying what the client needs to know."""

from __future__ import annotations

from typing import Any


class LeaseError(Exception):
    """Base error: an HTTP status, a stable ``reason`` slug, and a message for the user."""

    status_code = 500
    reason = "error"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        status_code: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        if status_code is not None:
            self.status_code = status_code
        self.extra = extra or {}

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status_code, "reason": self.reason, "message": self.message}
        body.update(self.extra)
        return body


class BadRequest(LeaseError):
    status_code = 400
    reason = "bad_request"


class Unauthorized(LeaseError):
    status_code = 401
    reason = "unauthorized"


class Forbidden(LeaseError):
    status_code = 403
    reason = "forbidden"


class NotFound(LeaseError):
    status_code = 404
    reason = "not_found"


class InvalidTransition(LeaseError):
    status_code = 409
    reason = "invalid_transition"


class TooManyRequests(LeaseError):
    status_code = 429
    reason = "too_many_requests"


class Unavailable(LeaseError):
    status_code = 503
    reason = "unavailable"
