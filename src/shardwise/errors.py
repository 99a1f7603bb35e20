"""The error a configuration raises when it does not add up (torch-free: the axis table raises it too)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that does not add up; the message says why and what to change."""
