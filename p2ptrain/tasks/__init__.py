"""Training tasks shared by the examples, the CLI, the tests and the convergence benchmarks.

>>> task = get_task("digits")                     # or get_task("char_lm", context=64, d_model=96)
>>> model = task.make_model(seed=0)               # same seed -> bit-identical init on every peer
>>> opt = task.make_optimizer(model.parameters())
>>> for x, y in task.batches(32, seed=0, rank=r, world=n):   # infinite, disjoint per rank
...     task.loss(model, (x, y)).backward(); ...
>>> task.evaluate(model)                          # {"loss": ..., "accuracy": ...}

A task owns its data, model, optimizer defaults and metrics so that a swarm of peers and the
single-process baseline (:func:`train_single`) train exactly the same thing: a benchmark that
compares them then measures the trainer, not a difference in set-up.

Everything is built offline (datasets that ship with installed packages, text from the Python
standard library) and deterministically, so peers that never exchanged a byte agree on the model
shape, the initial weights and the data; :attr:`Task.signature` summarises all of that in a short
string that peers can compare (or use as a DHT prefix) before averaging together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = ["TASKS", "Task", "get_task", "train_single"]

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]

#: task names accepted by :func:`get_task`
TASKS: tuple[str, ...] = ("digits", "char_lm")

#: optimizer names accepted by :meth:`Task.make_optimizer`
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under ``torch.manual_seed(seed)`` and restore the global RNG afterwards.

    Model init draws from torch's global generator; forking it keeps ``make_model`` from
    disturbing (or depending on) whatever else the process does with random numbers.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator that depends on (seed, epoch) only: every peer derives the same shuffle."""
    mixed = hashlib.sha256(f"p2ptrain-data/{seed}/{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") >> 1)


class Task:
    """A dataset + model + loss + metrics, identical on every peer that builds it.

    Subclasses set the class attributes, ``config`` (a dataclass of the options) and implement
    ``_build_model``, ``num_train``, ``train_batch``, ``loss`` and ``evaluate``; the shuffling,
    sharding and seeding live here once.
    """

    name: ClassVar[str]
    default_lr: ClassVar[float]
    default_batch_size: ClassVar[int]
    default_optimizer: ClassVar[str] = "adamw"
    weight_decay: ClassVar[float] = 0.01
    #: name of the metric where larger is better, used by benchmarks ("accuracy") or None when
    #: only the loss matters
    target_metric: ClassVar[str | None] = None

    config: Any

    # -- what subclasses provide -------------------------------------------------------------

    @property
    def num_train(self) -> int:
        """Number of training examples in one epoch (the unit that ``batches`` shuffles)."""
        raise NotImplementedError

    def train_batch(self, indices: Tensor, *, seed: int, epoch: int) -> Batch:
        """The training examples at ``indices`` of epoch ``epoch`` as an (inputs, targets) pair."""
        raise NotImplementedError

    def _build_model(self) -> nn.Module:
        raise NotImplementedError

    def record_batches(self, records: Iterator[Any], batch_size: int) -> Iterator[Batch]:
        """Batches from the records of a dataset (``p2ptrain.data``), in the order they come."""
        raise ValueError(f"task {self.name!r} cannot train from a dataset (char_lm can: text records)")

    def _data_digest(self) -> bytes:
        """Bytes that identify the data (hashed into :attr:`signature`)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Mean loss over ``batch``."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Metrics on the held-out set."""
        raise NotImplementedError

    # -- shared behaviour --------------------------------------------------------------------

    @property
    def options(self) -> dict[str, Any]:
        """The options this task was built with (defaults filled in)."""
        return dataclasses.asdict(self.config)

    @property
    def signature(self) -> str:
        """``<name>-<hash>`` of the name, options and data: peers with equal signatures train the
        same model on the same data; a different one means they must not average together."""
        h = hashlib.sha256(json.dumps([self.name, self.options], sort_keys=True).encode())
        h.update(self._data_digest())
        return f"{self.name}-{h.hexdigest()[:12]}"

    def make_model(self, seed: int = 0) -> nn.Module:
        """A fresh model; the same seed gives bit-identical parameters on every peer (for a given
        torch version), so a swarm can start without shipping the initial weights."""
        with seeded(seed):
            return self._build_model()

    def make_optimizer(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        name: str | None = None,
    ) -> torch.optim.Optimizer:
        """The task's local optimizer: ``default_optimizer`` at ``default_lr`` unless told."""
        name = (name or self.default_optimizer).lower()
        lr = self.default_lr if lr is None else float(lr)
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"learning rate must be a positive number, got {lr!r}")
        if name == "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)
        if name == "adam":
            return torch.optim.Adam(params, lr=lr)
        if name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True)
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")

    def epoch_indices(self, epoch: int, *, seed: int = 0, rank: int = 0, world: int = 1) -> Tensor:
        """Training-example indices that ``rank`` of ``world`` visits in ``epoch``, in order.

        Every rank draws the same permutation from (seed, epoch) and takes every ``world``-th
        entry starting at ``rank``: the ranks' slices are disjoint and their union is the epoch.
        """
        _check_shard(rank, world)
        perm = torch.randperm(self.num_train, generator=epoch_generator(seed, epoch))
        return perm[rank::world]

    def batches(
        self, batch_size: int, *, seed: int = 0, rank: int = 0, world: int = 1
    ) -> Iterator[Batch]:
        """Endless training batches, reshuffled each epoch with (seed, epoch).

        A rank sees a disjoint slice of each shuffled epoch (see :meth:`epoch_indices`), so
        ``world`` peers together see what one process sees. An epoch's last batch may be short
        rather than dropped, so that the slices cover the data exactly.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"batch_size must be an int, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        _check_shard(rank, world)
        if world > self.num_train:
            raise ValueError(
                f"world={world} exceeds the {self.num_train} training examples of {self.name!r}: "
                "some ranks would get no data"
            )
        return self._batches(batch_size, seed, rank, world)

    def _batches(self, batch_size: int, seed: int, rank: int, world: int) -> Iterator[Batch]:
        for epoch in itertools.count():
            idx = self.epoch_indices(epoch, seed=seed, rank=rank, world=world)
            for start in range(0, len(idx), batch_size):
                yield self.train_batch(idx[start : start + batch_size], seed=seed, epoch=epoch)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"


def _check_shard(rank: int, world: int) -> None:
    for what, v in (("rank", rank), ("world", world)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what} must be an int, got {v!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")


def build_config(config_cls: type, task_name: str, options: dict[str, Any]) -> Any:
    """Fill a task's option dataclass from keyword options, with errors that list what is valid.

    Values given as strings (from a command line or config file) are converted to the field's
    type, so the CLI can pass ``context=64`` through unchanged.
    """
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        valid = ", ".join(f"{f.name}={f.default!r}" for f in fields.values())
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for task {task_name!r}; valid: {valid}"
        )
    values: dict[str, Any] = {}
    for key, value in options.items():
        kind = type(fields[key].default)
        if isinstance(value, str) and kind is not str:
            try:
                value = kind(value)
            except ValueError:
                raise ValueError(
                    f"option {key}={value!r} for task {task_name!r}: expected {kind.__name__}"
                ) from None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise ValueError(
                f"option {key}={value!r} for task {task_name!r}: expected {kind.__name__}"
            )
        values[key] = value
    return config_cls(**values)


def get_task(name: str, **options: Any) -> Task:
    """The task called ``name`` ("digits" or "char_lm"), built with ``options``.

    Raises ValueError for an unknown name, an unknown option or a value out of range.
    """
    key = name.lower().replace("-", "_") if isinstance(name, str) else name
    # Imported here: digits pulls in scikit-learn and char_lm reads a corpus; a peer pays only
    # for the task it runs.
    if key == "digits":
        from .digits import DigitsTask

        return DigitsTask(**options)
    if key == "char_lm":
        from .char_lm import CharLMTask

        return CharLMTask(**options)
    raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")


def train_single(
    task: Task,
    steps: int,
    batch_size: int | None = None,
    lr: float | None = None,
    seed: int = 0,
    log_every: int = 0,
    stop_when: Callable[[dict[str, float]], bool] | None = None,
    eval_at: Iterable[int] = (),
    warmup_steps: int = 0,
) -> dict[str, Any]:
    """The single-process baseline: a plain torch loop over ``task`` for up to ``steps`` steps.

    ``warmup_steps``: the lr rises linearly over the first steps, exactly as a DiLoCo peer's
    ``inner_warmup_steps`` does (the same function), for a like-for-like comparison.

    Every ``log_every`` steps (0: never), and after every step in ``eval_at``, it evaluates, logs
    and records the metrics in ``history``, and stops early when ``stop_when(metrics)`` is true
    (e.g. to count the samples needed to reach an accuracy). ``seconds`` counts training only, not
    the evaluations, so it compares with a swarm's training time.

    Returns the final :meth:`Task.evaluate` metrics plus ``steps``, ``samples`` (examples
    consumed; sequences for char_lm), ``seconds``, ``train_loss`` (last batch) and ``history``.
    """
    from ..optim.warmup import warmed_step  # (lazy: the tasks need no networking stack)

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    batch_size = task.default_batch_size if batch_size is None else batch_size
    model = task.make_model(seed)
    model.train()
    opt = task.make_optimizer(model.parameters(), lr)
    data = task.batches(batch_size, seed=seed)
    history: list[dict[str, float]] = []
    samples, seconds, step, train_loss = 0, 0.0, 0, math.nan
    metrics: dict[str, float] | None = None
    eval_steps = set(eval_at)
    while step < steps:
        t0 = time.perf_counter()
        batch = next(data)
        loss = task.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        step += 1
        warmed_step(opt, step, warmup_steps)
        seconds += time.perf_counter() - t0
        samples += len(batch[1])
        train_loss = loss.item()
        metrics = None
        if (log_every and (step % log_every == 0 or step == steps)) or step in eval_steps:
            metrics = task.evaluate(model)
            history.append({"step": step, "samples": samples, "seconds": seconds, **metrics})
            log.info("%s step %d samples %d %.2fs train_loss %.4f %s", task.name, step, samples,
                     seconds, train_loss, _fmt(metrics))
            if stop_when is not None and stop_when(metrics):
                break
    if metrics is None:  # the last step was not evaluated yet
        metrics = task.evaluate(model)
    return {**metrics, "steps": step, "samples": samples, "seconds": seconds,
            "train_loss": train_loss, "history": history}


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
