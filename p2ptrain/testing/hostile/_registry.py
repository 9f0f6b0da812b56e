"""The registry the attack submodules fill (kept apart so that they import it, not the package)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Mode:
    """One attack: its name, what it does in a line, and the callable that carries it out (its
    signature is the attack's own: see each submodule)."""

    name: str
    what: str
    run: Callable[..., Any]


MODES: dict[str, Mode] = {}


def mode(name: str, what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated callable as the attack ``name``."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in MODES:
            raise ValueError(f"two attacks named {name!r}")
        MODES[name] = Mode(name, what, fn)
        return fn

    return register
