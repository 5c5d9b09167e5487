"""The exception hierarchy of hal. Every error hal raises on purpose derives from HalError."""

from __future__ import annotations


class HalError(Exception):
    """Base class of every error raised by hal."""


class InvalidArgumentError(HalError, ValueError):
    """An argument has the wrong shape, dtype, device, type or value.

    The message names the op, the argument, what was expected and what was given.
    """

    def __init__(self, op: str, arg: str, expected: str, got: str) -> None:
        self.op, self.arg, self.expected, self.got = op, arg, expected, got
        super().__init__(f"{op}: argument '{arg}' must be {expected}; got {got}")


class UnsupportedError(HalError, NotImplementedError):
    """No kernel can run these inputs; the message lists every candidate with its reasons."""


class BackendUnavailableError(HalError, RuntimeError):
    """A forced or needed backend is not installed or cannot be used here."""


class PluginError(HalError, ImportError):
    """A plugin failed to load, or was built for another plugin API version."""
