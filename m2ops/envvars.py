"""The environment variables m2ops reads (README, "Environment variables"), parsed in one place.

Every on/off switch accepts the same spellings, and a value that is none of them is an error that names the
variable. Before, each reader had its own rule: M2OPS_PDL=false or M2OPS_INDEX32=off silently meant on, and
M2OPS_FORCE_REFERENCE=false meant forced.
"""

from __future__ import annotations

import os

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def switch(name: str, default):
    """The on/off variable name: True for 1, true, on or yes; False for 0, false, off or no (any case, spaces
    around ignored); default (whatever the caller's "not set" means, e.g. None for "the launcher's choice")
    when unset or empty. Anything else raises ValueError."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value == "":
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (or true/false, on/off, yes/no), or unset for the default")


def _non_negative(name: str, what: str):
    """The variable's value as a float >= 0, or None when unset or empty; else ValueError naming it and what it
    should be."""
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return None
    error = ValueError(f"{name}={raw!r}: expected {what} >= 0")
    try:
        value = float(raw)
    except ValueError:
        raise error from None
    if not value >= 0.0:  # (also rejects nan)
        raise error
    return value


def seconds(name: str, default: float) -> float:
    """A non-negative number of seconds from the variable name, default when unset or empty; else ValueError."""
    value = _non_negative(name, "a number of seconds")
    return default if value is None else value


def mebibytes(name: str, default: float) -> int:
    """A non-negative size in MiB from the variable name (default when unset or empty), as bytes; else
    ValueError."""
    value = _non_negative(name, "a size in MiB")
    return int((default if value is None else value) * 2 ** 20)
