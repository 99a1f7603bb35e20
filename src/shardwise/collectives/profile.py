"""The cost model's profile as a run names it (``comm.profile``): found, checked and loaded.

No communication: a file ``shardwise bench comm`` wrote, read before any rank starts (``preflight``)
and by each rank when it builds its ``Comm``s.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Protocol

from shardwise.collectives import cost
from shardwise.config import ConfigError


class CommSettings(Protocol):
    """What a ``Comm`` reads from the config (``config.CommConfig``)."""

    @property
    def algorithm(self) -> str: ...

    @property
    def profile(self) -> str: ...


MAX_PROFILE_BYTES = 1 << 20  # a profile `shardwise bench comm` writes is a few kB


def load_profile(path: str) -> cost.CostProfile | None:
    """The cost-model profile at ``path``; with no path, the one ``shardwise bench comm`` saved here, if any.

    A path that was named but does not exist, or a file that is no profile (not a regular file, not
    JSON, a value of the wrong kind), is a one-line ``ConfigError`` naming it (``preflight`` calls this
    before any rank starts).
    """
    where = Path(path or cost.DEFAULT_PROFILE_PATH)
    named = f"comm.profile {path}" if path else f"the saved comm profile {where}"
    if not where.exists():
        if path:
            raise ConfigError(f"comm.profile {path} does not exist; `shardwise bench comm` makes one")
        return None
    if not where.is_file():  # a folder, /dev/zero, a pipe: nothing to read, or no end to it
        raise ConfigError(f"{named} is not a regular file; give the JSON file `shardwise bench comm` writes")
    if where.stat().st_size > MAX_PROFILE_BYTES:
        raise ConfigError(
            f"{named} has {where.stat().st_size} bytes, more than a profile's {MAX_PROFILE_BYTES}; "
            "give the JSON file `shardwise bench comm` writes"
        )
    try:
        profile = cost.CostProfile.load(str(where))
        numbers = [getattr(profile, f.name) for f in fields(profile) if f.type in (float, "float")]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise TypeError("a constant is not a number")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever json says
        raise ConfigError(
            f"{named} is not a cost profile ({reason}); run `shardwise bench comm` again, or give "
            "another comm.profile"
        ) from None
    return profile


