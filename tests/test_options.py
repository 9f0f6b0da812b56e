"""The optimizer's options, checked once (``optim.options``), and the step-cycle rate the swarm
predicts epochs with (``optim.stats.CycleRate``): sans-IO, no swarm."""

from __future__ import annotations

import dataclasses

import pytest

from p2ptrain.optim.options import OptionError, TrainerOptions, check_options
from p2ptrain.optim.stats import CycleRate


@pytest.mark.parametrize("given, argument, flag", [
    ({"mode": "async"}, "mode must be one of sync, diloco", "--mode must be one of"),
    ({"run_id": "a/b"}, "run_id must be a non-empty string", "--run-id"),
    ({"run_id": ""}, "run_id must be a non-empty string", "--run-id"),
    ({"target_batch_size": 0}, "target_batch_size and batch_size_per_step", "--target-batch-size"),
    ({"batch_size_per_step": 0}, "target_batch_size and batch_size_per_step", "--batch-size"),
    ({"local_steps": 0}, "local_steps must be at least 1", "--local-steps"),
    ({"outer_lr": 0.0}, "outer_lr must be positive", "--outer-lr"),
    ({"outer_lr": float("inf")}, "outer_lr must be positive", "--outer-lr"),
    ({"outer_momentum": 1.0}, "outer_momentum in [0, 1)", "--outer-lr must be positive and --outer-momentum"),
    ({"inner_warmup_steps": -1}, "inner_warmup_steps must be a non-negative int", "--inner-warmup-steps"),
    ({"inner_warmup_steps": 1.5}, "inner_warmup_steps must be a non-negative int", "--inner-warmup-steps"),
    ({"inner_warmup_steps": 10}, "inner_warmup_steps is for diloco mode", "--inner-warmup-steps is for --mode diloco"),
    ({"checkpoint_every": 0}, "checkpoint_every must be a positive number", "--checkpoint-every"),
    ({"checkpoint_every": True}, "checkpoint_every must be a positive number", "--checkpoint-every"),
])
def test_each_bad_option_is_named_for_the_library_and_for_the_cli(given, argument, flag):
    with pytest.raises(OptionError) as caught:
        check_options(**given)
    assert argument in str(caught.value) and caught.value.flag_message.startswith(flag)
    assert isinstance(caught.value, ValueError)  # (callers that catch ValueError still do)


def test_options_not_given_are_not_checked_and_good_ones_pass():
    check_options()  # nothing given: nothing to refuse
    check_options(mode="diloco", run_id="run-1", target_batch_size=64, batch_size_per_step=8, local_steps=5,
                  outer_lr=0.7, outer_momentum=0.9, inner_warmup_steps=10, checkpoint_every=5)


def test_a_codec_or_aggregation_typo_fails_before_any_network_starts():
    with pytest.raises(ValueError, match="int9"):
        check_options(compression="int9")
    with pytest.raises(ValueError, match="median_of_means"):
        check_options(aggregation="median_of_means")


def test_trainer_options_check_on_construction_and_are_frozen():
    with pytest.raises(OptionError, match="target_batch_size"):
        TrainerOptions(run_id="r", target_batch_size=0)
    opts = TrainerOptions(run_id="r", mode="sync", local_steps=0, trusted_writers=["a", "b"])  # (sync: no local steps)
    assert opts.trusted_writers == ("a", "b") and opts.codec == "none" and opts.state_every == 5
    assert TrainerOptions(run_id="r", mode="diloco").codec == "int8"
    assert TrainerOptions(run_id="r", average_state_every=0).state_every == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.mode = "diloco"  # type: ignore[misc]


def test_the_cycle_rate_is_samples_over_seconds_less_the_pauses():
    rate = CycleRate()
    assert rate.tick(32, 0.0, 10.0) == 0.0  # no complete cycle yet
    assert rate.tick(32, 0.0, 10.1) == pytest.approx(320.0)
    # a cycle of 0.3 s, 0.2 s of it averaging: the training loop's own rate is unchanged
    assert rate.tick(32, 0.2, 10.4) == pytest.approx(320.0)


def test_the_cycle_rate_averages_samples_and_seconds_apart():
    """Fast and slow cycles in turn (a busy CPU): averaging per-cycle rates would be dominated by
    the fast ones; the rate is total samples over total time, as the swarm will see it."""
    rate, now = CycleRate(), 0.0
    rate.tick(32, 0.0, now)
    for i in range(400):
        now += 0.001 if i % 2 else 0.099  # 32 samples in 1 ms, then 32 in 99 ms: 640 samples/s overall
        sps = rate.tick(32, 0.0, now)
    assert sps == pytest.approx(640.0, rel=0.1)
