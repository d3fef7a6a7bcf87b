"""Typed errors that a user or a config controls (tier two of STYLE's three tiers).

Each names the bad value and the allowed range; the services map them to a gRPC status and
the router to an OpenAI error body.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """A request (prompt, sampling parameters) is invalid; maps to HTTP 400 / INVALID_ARGUMENT."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_tokens exceeds max_model_len; maps to HTTP 400 (OpenAI's context_length_exceeded)."""


class ConfigError(PdserveError, ValueError):
    """A configuration value is invalid or inconsistent; raised at start, names the fix."""


class CapacityError(PdserveError):
    """No capacity to take the request now; maps to HTTP 503 / RESOURCE_EXHAUSTED."""


class UnsupportedError(PdserveError, NotImplementedError):
    """A case no implementation supports (a kernel shape, a model feature); never silently falls back."""


class EngineStalledError(PdserveError, RuntimeError):
    """The engine cannot make progress: a device step outlived ``step_timeout_s``, or requests
    remain that no step can ever schedule. Names what it waited for and the setting."""


class EngineDeadError(PdserveError, RuntimeError):
    """The node's engine thread (or a stage process) died: nothing more can be served here. The
    node turns NOT_SERVING and exits non-zero; maps to gRPC UNAVAILABLE so the router goes elsewhere."""


class EngineWedgedError(EngineDeadError):
    """The node's engine thread has been in one step past ``step_timeout_s``: the node takes no
    request until the step ends (services/engine_watchdog.py); UNAVAILABLE, as a dead engine."""
