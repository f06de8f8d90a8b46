"""--callback module:Class[,module:Class]: the user's own components, imported by name (as
--model module:callable) and made with no arguments; each overrides the events of
psrt.train.events.Callback it needs (examples/callback_steps.py)."""
from __future__ import annotations

import importlib

from psrt.errors import PsrtError
from psrt.train.events import EVENTS


def names(spec: str | None) -> list[str]:
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def load(spec: str | None) -> list:
    """The components `spec` names, each made once (on every rank)."""
    return [make(name) for name in names(spec)]


def make(name: str):
    module_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise PsrtError(f"--callback {name}: cannot import {module_name} ({err})", everywhere=True) from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise PsrtError(f"--callback {name}: {module_name} has no {attr}", everywhere=True)
    if not callable(obj):
        raise PsrtError(f"--callback {name}: {attr} is not a class", everywhere=True)
    try:
        component = obj()
    except Exception as err:  # noqa: BLE001 - the user's code: one clear line
        raise PsrtError(f"--callback {name}: {attr}() failed ({type(err).__name__}: {err})",
                        everywhere=True) from None
    if not any(callable(getattr(component, e, None)) for e in EVENTS):
        raise PsrtError(f"--callback {name}: {attr} has none of the events {', '.join(EVENTS)} "
                        "(subclass psrt.train.events.Callback)", everywhere=True)
    return component
