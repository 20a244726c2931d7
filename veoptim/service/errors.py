"""What a client is told: one sentence, an HTTP status and the SDK's error category."""

from __future__ import annotations

USER, SERVER = "user", "server"


class ServiceError(Exception):
    """A refused or failed request. ``status`` is the HTTP answer when refused at submit;
    ``category`` (``user`` / ``server``) the category when a future fails."""

    def __init__(self, message: str, status: int = 400, category: str = USER) -> None:
        super().__init__(message)
        self.message, self.status, self.category = message, status, category


class NotFound(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=404)


class Unauthorized(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=401)


class Gone(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=410)


class TooLarge(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=413)
