"""Robust aggregation rules: combine the contributions of several senders to one chunk so that a
minority of hostile senders cannot move the result arbitrarily far.

Sans-IO: pure functions over a stack ``x`` of contributions, shape ``[k, n]`` (one row per sender,
float32), and their weights ``w``, shape ``[k]`` (samples behind each row). The all-reduce owner
calls :func:`aggregate` once per chunk of its shard, after every expected sender delivered (or gave
up on) that chunk.

* ``mean``: the weighted mean. Not robust: one sender can move it anywhere.
* ``trimmed_mean``: coordinate-wise, drop the ``f`` largest and ``f`` smallest values
  (``f = ceil(trim * k)``, at most ``(k - 1) // 2``), weighted mean of the rest. Up to ``f``
  hostile rows leave every coordinate inside the range of the honest values. Rounding up keeps
  a group that formed smaller than planned protected (3 members with trim 0.25: f = 1, not 0).
* ``median``: coordinate-wise median (unweighted). Fewer than ``k / 2`` hostile rows leave every
  coordinate inside the range of the honest values.
* ``centered_clip``: CenteredClip (Karimireddy, He & Jaggi, ICML 2021; as in hivemind, starting
  from the coordinate-wise median): ``v <- v + sum_i c_i (x_i - v)`` with ``c_i = w_i / sum(w) *
  min(1, tau / ||x_i - v||)``. Every step moves ``v`` by at most ``tau`` whatever the outliers,
  so ``iters`` steps stay within ``iters * tau`` of the median. ``tau=None`` (default) takes the
  median distance of the rows from the median: gradients have no natural scale, and an absolute
  ``tau`` that suits one model's gradients either clips nothing or everything on another's.

Why groups of 2 are refused: with ``k = 2`` no rule can tell the hostile row from the honest one
(the trimmed mean trims nothing, the median of two is their mean), so a hostile peer that lands in
a pair, e.g. when a round's matchmaking splits the swarm, moves its partner as freely as under
``mean``. The averager therefore asks matchmaking for groups of at least :data:`MIN_ROBUST_GROUP`
when the swarm has that many peers; a peer that cannot join one steps on its own gradient.

Why weights are capped: a sender declares its own weight (samples), so under a robust rule each
weight is capped at the median declared weight; otherwise one peer claiming a huge batch would buy
back the influence the rule takes away. (``mean`` keeps the declared weights: it trusts peers.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["AGGREGATIONS", "MIN_ROBUST_GROUP", "check_codec", "aggregate", "centered_clip", "check_aggregation", "mean",
           "median", "trimmed_mean"]

AGGREGATIONS = ("mean", "trimmed_mean", "median", "centered_clip")
DEFAULT_TRIM = 0.25  # the threat model: up to a quarter of the peers hostile
DEFAULT_CLIP_ITERS = 20
MIN_ROBUST_GROUP = 3  # the smallest group in which one hostile row can be outvoted (see above)


def check_aggregation(name: object) -> str:
    """``name`` if it is a known aggregation, else ValueError naming the choices."""
    if not isinstance(name, str) or name not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {name!r:.40}: choose one of {', '.join(AGGREGATIONS)}")
    return name


#: codecs whose parts are sparse: each peer sends its own few coordinates and zeros elsewhere
SPARSE_CODECS = ("topk",)


def check_codec(aggregation: str, codec: str) -> None:
    """ValueError if ``aggregation`` cannot combine parts encoded with ``codec``.

    A robust rule compares the peers' values coordinate by coordinate; with top-k parts almost
    every coordinate is a zero from all but one peer, so the median or trimmed mean is zero
    nearly everywhere and training silently stalls. Said at construction, not found in training."""
    if aggregation != "mean" and codec in SPARSE_CODECS:
        raise ValueError(f"aggregation {aggregation!r} cannot combine {codec!r} parts (each peer sends its own few "
                         "coordinates, so a coordinate-wise rule sees mostly zeros): use aggregation 'mean', or a "
                         "dense codec (none, fp16, bf16, int8)")


def _check(x: Tensor, w: Tensor) -> None:
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"contributions must be a [k, n] tensor with k >= 1, got shape {list(x.shape)}")
    if w.shape != (x.shape[0],):
        raise ValueError(f"weights must have shape [{x.shape[0]}], got {list(w.shape)}")
    if not bool((w > 0).all()) or not bool(torch.isfinite(w).all()):
        raise ValueError("weights must be finite and > 0")


def _capped(w: Tensor) -> Tensor:
    """Each weight capped at the (lower) median weight: see the module docstring."""
    w = w.to(torch.float32)
    return torch.minimum(w, w.median())


def _out(out: Tensor | None, like: Tensor) -> Tensor:
    return torch.empty_like(like) if out is None else out


def mean(x: Tensor, w: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Weighted mean of the rows."""
    _check(x, w)
    wf = w.to(x.dtype)
    return torch.div(wf @ x, wf.sum(), out=_out(out, x[0]))


def _sorted(x: Tensor) -> tuple[Tensor, Tensor]:
    if x.shape[0] == 1:
        return x, torch.zeros_like(x, dtype=torch.long)
    s = x.sort(dim=0)
    return s.values, s.indices


def trimmed_mean(x: Tensor, w: Tensor, trim: float = DEFAULT_TRIM, *, out: Tensor | None = None) -> Tensor:
    """Coordinate-wise trimmed mean: per coordinate, drop the ``f`` largest and ``f`` smallest
    values (``f = ceil(trim * k)``, at most ``(k - 1) // 2`` so something is left) and take the
    weighted mean of the others (weights capped at the median)."""
    _check(x, w)
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    k = x.shape[0]
    f = min(math.ceil(trim * k - 1e-9), (k - 1) // 2)
    wc = _capped(w)
    if f == 0:
        return mean(x, wc, out=out)
    vals, idx = _sorted(x)
    kept, kidx = vals[f : k - f], idx[f : k - f]
    kw = wc.to(x.dtype)[kidx]  # the weight of the row each kept value came from
    num = (kept * kw).sum(0)
    return torch.div(num, kw.sum(0), out=_out(out, x[0]))


def median(x: Tensor, w: Tensor | None = None, *, out: Tensor | None = None) -> Tensor:
    """Coordinate-wise median (the mean of the two middle values when ``k`` is even); unweighted."""
    if w is not None:
        _check(x, w)
    k = x.shape[0]
    vals, _ = _sorted(x)
    o = _out(out, x[0])
    if k % 2:
        return o.copy_(vals[k // 2])
    return torch.add(vals[k // 2 - 1], vals[k // 2], out=o).mul_(0.5)


def centered_clip(x: Tensor, w: Tensor, tau: float | None = None, iters: int = DEFAULT_CLIP_ITERS, *,
                  out: Tensor | None = None) -> Tensor:
    """CenteredClip from the coordinate-wise median, ``iters`` steps of radius ``tau`` (None: the
    median distance of the rows from the median). Stops early once a step is negligible."""
    _check(x, w)
    if tau is not None and not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    wc = _capped(w).to(x.dtype)
    wc = wc / wc.sum()
    v = median(x)
    diff = x - v
    norms = torch.linalg.vector_norm(diff, dim=1)
    t = float(norms.median()) if tau is None else float(tau)
    for _ in range(iters):
        if t <= 0:
            break
        coeffs = wc * torch.clamp(t / norms.clamp_min(1e-30), max=1.0)
        step = coeffs @ diff
        v.add_(step)
        diff.sub_(step)  # diff = x - v, kept up to date without recomputing it
        snorm = float(torch.linalg.vector_norm(step))
        if snorm <= 1e-7 * (float(torch.linalg.vector_norm(v)) + t):
            break
        norms = torch.linalg.vector_norm(diff, dim=1)
    return v if out is None else out.copy_(v)


def aggregate(name: str, x: Tensor, w: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Combine the rows of ``x`` (``[k, n]``) with weights ``w`` (``[k]``) by rule ``name``."""
    if name == "mean":
        return mean(x, w, out=out)
    if name == "trimmed_mean":
        return trimmed_mean(x, w, out=out)
    if name == "median":
        _check(x, w)
        return median(x, out=out)
    if name == "centered_clip":
        return centered_clip(x, w, out=out)
    raise ValueError(check_aggregation(name))  # unreachable for known names; names the choices
