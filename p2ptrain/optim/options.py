"""The options of a :class:`~p2ptrain.optim.optimizer.DecentralizedOptimizer`, checked once.

:class:`TrainerOptions` holds the optimizer's keyword arguments, validated on construction;
:func:`check_options` runs the same checks on the options given, for the CLI, which reports them
in terms of its flags (``OptionError.flag_message``). Torch is imported only by the aggregation and
codec checks, so that the CLI can check its other flags without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import P2PTrainError

MODES = ("sync", "diloco")


class OptionError(P2PTrainError, ValueError):
    """A bad option: the message names the keyword argument, ``flag_message`` the CLI flag."""

    def __init__(self, message: str, flag_message: str) -> None:
        super().__init__(message)
        self.flag_message = flag_message


def _check_run_id(run_id: object) -> None:
    from ..checkpoint.record import MAX_RUN_ID, RecordError, check_run_id

    try:
        check_run_id(run_id)
    except RecordError as e:
        raise OptionError(f"run_id must be a non-empty string of at most {MAX_RUN_ID} printable characters "
                          "without '/'", f"--run-id: {e}") from None


def check_options(**given: Any) -> None:
    """Check the options given (named as ``DecentralizedOptimizer``'s keyword arguments; those
    not given are not checked): ``OptionError`` (or the codec's or aggregation's ``ValueError``)
    for the first that cannot work."""
    mode = given.get("mode", "sync")
    if "mode" in given and mode not in MODES:
        raise OptionError(f"mode must be one of {', '.join(MODES)}, got {mode!r}",
                          f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if "run_id" in given:
        _check_run_id(given["run_id"])
    if given.get("target_batch_size", 1) < 1:
        raise OptionError("target_batch_size and batch_size_per_step must be positive",
                          "--target-batch-size must be at least 1")
    if given.get("batch_size_per_step", 1) < 1:
        raise OptionError("target_batch_size and batch_size_per_step must be positive",
                          "--batch-size must be at least 1")
    if given.get("target_group_size", 1) < 1:
        raise OptionError("target_group_size must be at least 1", "--target-group-size must be at least 1")
    if given.get("local_steps", 1) < 1:
        raise OptionError("local_steps must be at least 1", "--local-steps must be at least 1")
    if not (0 < given.get("outer_lr", 1.0) < math.inf) or not (0 <= given.get("outer_momentum", 0.0) < 1):
        raise OptionError("outer_lr must be positive and outer_momentum in [0, 1)",
                          "--outer-lr must be positive and --outer-momentum in [0, 1)")
    warmup = given.get("inner_warmup_steps", 0)
    if type(warmup) is not int or warmup < 0:
        raise OptionError(f"inner_warmup_steps must be a non-negative int, got {warmup!r}",
                          "--inner-warmup-steps cannot be negative")
    if warmup and mode != "diloco":
        raise OptionError("inner_warmup_steps is for diloco mode (sync peers must all take the same step: "
                          "warm up with scheduler=, stepped per global epoch)",
                          "--inner-warmup-steps is for --mode diloco (sync peers must all take the same step)")
    if given.get("overlap_outer") and mode != "diloco":
        raise OptionError("overlap_outer is for diloco mode (sync overlaps its rounds with delay_updates)",
                          "--overlap-outer is for --mode diloco (sync: --delay-updates)")
    every = given.get("checkpoint_every")
    if every is not None and (type(every) is not int or every < 1):
        raise OptionError(f"checkpoint_every must be a positive number of epochs, got {every!r}",
                          "--checkpoint-every must be at least 1 (epochs between checkpoints)")
    if "aggregation" in given or "compression" in given:  # (these need torch)
        from ..averaging.robust import check_aggregation, check_codec
        from ..compression import get_codec

        aggregation = check_aggregation(given.get("aggregation", "mean"))
        codec = given.get("compression") or default_codec(mode)
        get_codec(codec)  # a typo fails here, with the list of codecs, before any network starts
        check_codec(aggregation, codec)


def default_codec(mode: str) -> str:
    """The codec a mode averages with unless told: int8 pseudo-gradients in diloco, exact gradients in sync."""
    return "int8" if mode == "diloco" else "none"


@dataclass(frozen=True)
class TrainerOptions:
    """``DecentralizedOptimizer``'s keyword arguments (see its docstring), checked on construction."""

    run_id: str
    target_batch_size: int = 4096
    batch_size_per_step: int = 32
    mode: str = "sync"
    local_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_warmup_steps: int = 0
    compression: str | None = None
    aggregation: str = "mean"
    target_group_size: int = 16
    mixing: bool = True  # a grid of groups that changes every round once the swarm outgrows a group
    delay_updates: bool = False
    overlap_outer: bool = False
    matchmaking_timeout: float = 5.0
    averaging_timeout: float | None = None  # None: derived (p2ptrain.deadlines)
    refresh_period: float = 0.5
    bandwidth: float = 1.0
    load_state_timeout: float | None = None  # None: derived (p2ptrain.deadlines)
    average_state_every: int | None = None
    outer_momentum_in_state: bool = False
    checkpoint_every: int | None = None
    checkpoint_dir: str | Path | None = None
    checkpoint_keep: int = 3
    checkpoint_writers: int = 3
    trusted_writers: Sequence[Any] = ()

    def __post_init__(self) -> None:
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.mode != "diloco":  # (sync mode takes no local steps)
            del given["local_steps"]
        check_options(**given)
        object.__setattr__(self, "trusted_writers", tuple(self.trusted_writers))

    @property
    def codec(self) -> str:
        """The codec the gradients (sync) or pseudo-gradients (diloco) are averaged with."""
        return self.compression or default_codec(self.mode)

    @property
    def state_every(self) -> int:
        """Epochs between two rounds that average the state itself (0: never)."""
        if self.average_state_every is not None:
            return self.average_state_every
        return 5 if self.mode == "sync" else 10

    @property
    def wants_checkpoints(self) -> bool:
        """Whether this peer saves checkpoints or resumes from them."""
        return self.checkpoint_every is not None or self.checkpoint_dir is not None
