"""Hostile peers: contribution receipt attacks (see the package docstring): what one member can sign
about the rounds it took part in (:mod:`p2ptrain.contrib`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._registry import mode

__all__ = ["receipt_inflate"]


@mode("receipt_inflate", "a member signs receipts crediting itself with 100 times its samples and no exclusion")
def receipt_inflate(book: Any, factor: int = 100) -> None:
    """``book``: the hostile peer's ContributionBook; its receipts stay validly signed, by itself."""
    honest = book._receipt

    def inflated(result: Any, run: str, compute_s: float) -> Any:
        r = honest(result, run, compute_s)
        me = result.allreduce.rank
        lines = list(r.lines)
        lines[me] = dataclasses.replace(lines[me], samples=max(1, lines[me].samples) * factor, excluded=False)
        return dataclasses.replace(r, lines=tuple(lines), why={k: v for k, v in r.why.items() if k != me})

    book._receipt = inflated
