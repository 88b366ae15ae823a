"""The spellings of an on/off `SUPA_*` variable, and whether `SUPA_EMULATE` asks for emulation.

A leaf module that imports nothing but `os`: the `supa_emu.pth` start-up line and the autoload
entry point call `emulation_wanted()` in every Python process, and `config.py` validates its
switches with `parse()`, so the accepted spellings exist once.
"""

from __future__ import annotations

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")


def parse(raw: str) -> bool | None:
    """True or False for an accepted spelling (case and surrounding blanks ignored), else None."""
    value = raw.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    return None


def emulation_wanted() -> bool:
    """True unless SUPA_EMULATE is unset or spelled "off".

    A value that is no switch at all counts as wanted, so activation goes on to `config.load()`,
    which rejects it with a ConfigError naming the accepted values.
    """
    raw = os.environ.get("SUPA_EMULATE")
    return raw is not None and parse(raw) is not False
