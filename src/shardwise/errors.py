"""The errors a configuration raises when it does not add up, or asks for what is not built yet
(torch-free: the axis table raises them too)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that does not add up; the message says why and what to change."""


class NotBuiltError(ConfigError):
    """The config asks for a kind of parallelism this version does not have yet."""
