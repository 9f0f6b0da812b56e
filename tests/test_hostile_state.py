"""A peer that lies about its progress or serves a state of its own making cannot take over the
swarm (issue 27, item 1): epoch claims are believed on evidence only (``optim.claims``), a loaded
state must carry the epoch it is asked for and, under a robust rule, a majority of its providers,
and hyper-parameters never come from peers (``optim.adopt``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from dht import Identity
from p2ptrain import DHT, DecentralizedOptimizer
from p2ptrain.checkpoint import StateTransferError
from p2ptrain.optim.adopt import Schedule, optimizer_state
from p2ptrain.optim.claims import EpochJudge
from p2ptrain.optim.progress import PeerReport
from p2ptrain.optim.state_sync import StateSync, vet
from p2ptrain.testing.hostile import MODES

pytestmark = pytest.mark.timeout(120)

RUN = "hostile-state"


@pytest.fixture
def nodes(dhts):
    return dhts


def make(dht: DHT, seed: int, lr: float = 0.05, **kw) -> tuple[torch.nn.Module, DecentralizedOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), dht=dht, run_id=RUN,
                                 target_batch_size=32, batch_size_per_step=16, **kw)
    return model, opt


def train(model, opt, until: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    while opt.epoch < until:
        x = torch.randn(16, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step(batch_size=16)
        opt.zero_grad()


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
def test_a_peer_claiming_a_far_epoch_takes_over_nobody(nodes, aggregation):
    honest = [make(nodes(), 0, aggregation=aggregation) for _ in range(2)]
    _, liar = make(nodes(), 0, aggregation=aggregation)
    try:
        MODES["epoch_claim"].run(liar, 10**9)
        threads = [threading.Thread(target=train, args=(m, o, 6, i)) for i, (m, o) in enumerate(honest)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        for _, o in honest:
            assert 6 <= o.epoch < 10**9 and o._applied < 10**9
            assert [g["lr"] for g in o.inner.param_groups] == [0.05]
            assert all(p.abs().max() < 100 for p in o.params)
            assert "epoch claim refused" in o.stats.excluded.get(str(liar.tracker.me.peer), "")
        # a newcomer takes the honest peers' state, not the claimant's, and keeps its own lr
        _, joiner = make(nodes(), 1, lr=0.02, aggregation=aggregation)
        try:
            assert joiner.stats.state_loads == 1 and 6 <= joiner.epoch < 10**9
            assert [g["lr"] for g in joiner.inner.param_groups] == [0.02]
            assert all(torch.equal(a, b) for a, b in zip(joiner.params, honest[0][1].params))
        finally:
            joiner.close()
    finally:
        for _, o in [*honest, (None, liar)]:
            o.close()


def test_a_loaded_state_keeps_our_hyper_parameters_and_replays_our_schedule(nodes):
    """The provider trains with lr 0.5 and a schedule of its own; the joiner's lr is its own
    schedule's at the epoch it loads (StepLR: halved every 2 epochs from 0.1), not the provider's."""
    model, provider = make(nodes(), 0, lr=0.5, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.1))
    try:
        train(model, provider, 5, 0)
        assert provider.inner.param_groups[0]["lr"] == pytest.approx(0.5 * 0.1 ** 2)
        _, joiner = make(nodes(), 1, lr=0.1, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5))
        try:
            assert joiner.stats.state_loads == 1 and joiner.epoch == provider.epoch == 5
            assert joiner.inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
            assert joiner.scheduler.last_epoch == 5
            assert joiner.inner.param_groups[0]["momentum"] == 0.9
            assert all(torch.equal(a, b) for a, b in zip(joiner.params, provider.params))
        finally:
            joiner.close()
    finally:
        provider.close()


def test_a_state_larger_than_our_model_is_refused_before_it_is_fetched(nodes):
    _, liar = make(nodes(), 0)
    try:
        source = MODES["huge_state"].run(liar, 3, 60 << 30)
        _, joiner = make(nodes(), 1, load_state_timeout=10.0)
        try:
            assert joiner.stats.state_loads == 0 and joiner.epoch == 0 and source.chunks_sent == 0
        finally:
            joiner.close()
    finally:
        liar.close()


# ---- sans-IO parts


def _report(peer, epoch, t=100.0, addr=("127.0.0.1", 1)):
    return PeerReport(peer, epoch, 0, 10.0, t, "s", addr=addr)


def test_the_judge_believes_a_majority_and_a_plausible_pace_not_a_jump():
    me, a, b, liar = (Identity().peer_id for _ in range(4))
    judge = EpochJudge(strict=False)
    verdict = judge.judge([_report(a, 7), _report(b, 8), _report(liar, 10**9)], _report(me, 7), counts_me=True,
                          now=100.0, my_sps=100.0, samples_per_epoch=1000)
    assert set(verdict) == {liar} and "claims epoch 1000000000" in verdict[liar]
    # a claimed speed does not buy a lead: with one honest peer, the slower of the two speeds counts
    fast = EpochJudge(strict=True)
    fast_liar = PeerReport(liar, 10**6, 0, 1e11, 100.0, "s", addr=("127.0.0.1", 1))
    assert set(fast.judge([_report(a, 7), fast_liar], _report(me, 7), counts_me=True, now=100.0, my_sps=100.0,
                          samples_per_epoch=1000)) == {liar}
    # a fresh joiner (no say) with one honest peer and one liar: neither is a majority of two
    fresh = EpochJudge(strict=False)
    assert set(fresh.judge([_report(a, 7), _report(liar, 10**9)], _report(me, 0), counts_me=False, now=100.0,
                           my_sps=0.0, samples_per_epoch=1000)) == {liar}
    # alone with one other peer, it is believed as far as the quorum allows...
    assert fresh.judge([_report(a, 8)], _report(me, 0), counts_me=False, now=100.0, my_sps=0.0,
                       samples_per_epoch=1000) == {}
    # ...and (mean) ahead of us at the swarm's pace from where it was believed, not faster
    two = EpochJudge(strict=False)
    assert two.judge([_report(a, 8)], _report(me, 8), counts_me=True, now=100.0, my_sps=100.0,
                     samples_per_epoch=1000) == {}
    # rate: 8 x 100 samples/s x 2 peers / 1000 samples an epoch = 1.6 epochs/s, + 1 epoch of slack
    assert two.judge([_report(a, 20, t=110.0)], _report(me, 8), counts_me=True, now=110.0, my_sps=100.0,
                     samples_per_epoch=1000) == {}
    assert set(two.judge([_report(a, 40, t=111.0)], _report(me, 8), counts_me=True, now=111.0, my_sps=100.0,
                         samples_per_epoch=1000)) == {a}
    strict = EpochJudge(strict=True)  # a robust rule: the quorum only
    assert strict.judge([_report(a, 8)], _report(me, 8), counts_me=True, now=100.0, my_sps=100.0,
                        samples_per_epoch=1000) == {}
    assert set(strict.judge([_report(a, 12, t=110.0)], _report(me, 8), counts_me=True, now=110.0, my_sps=100.0,
                            samples_per_epoch=1000)) == {a}


def _fetched(epoch, votes):
    return SimpleNamespace(manifest=SimpleNamespace(meta={"epoch": epoch}), votes=votes)


def test_a_fetched_state_must_carry_the_epoch_asked_for_and_under_a_robust_rule_a_majority():
    a, b = Identity().peer_id, Identity().peer_id
    providers = [_report(a, 9), _report(b, 9)]
    vet(_fetched(9, (2, 2)), providers, 9, strict=True)
    with pytest.raises(StateTransferError, match="labelled epoch 8"):  # a provider still in the round we missed
        vet(_fetched(8, (2, 2)), providers, 9, strict=False)
    with pytest.raises(StateTransferError, match="labelled epoch 1000000000"):  # more than they claim
        vet(_fetched(10**9, (2, 2)), providers, 9, strict=False)
    with pytest.raises(StateTransferError, match="1 of the 2 peers"):
        vet(_fetched(9, (1, 2)), providers, 9, strict=True)
    vet(_fetched(9, (1, 2)), providers, 9, strict=False)  # mean: the plurality, as before
    # providers snapshot when asked: past what they published, as far as a fresh read believes
    vet(_fetched(12, (2, 2)), providers, 9, strict=True, claimed=13)
    # a robust rule downloads from an epoch two peers serve, not from a lone peer ahead of them
    lone = [_report(a, 12), _report(b, 9), _report(Identity().peer_id, 9)]
    assert {p.epoch for p in StateSync.choose(lone, quorum=True)} == {9}
    assert {p.epoch for p in StateSync.choose(lone)} == {12}


def test_optimizer_state_from_peers_is_tensors_and_counters_under_our_groups():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    ours = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.9))
    theirs = {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}},
              "param_groups": [{"lr": 1000.0, "betas": (0.0, 0.0), "params": [0, 1]}]}
    ours.load_state_dict(optimizer_state(theirs, ours))
    assert ours.param_groups[0]["lr"] == 0.01 and ours.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(ours.state[params[0]]["exp_avg"], torch.ones(3))
    for bad, why in [({"state": {5: {}}}, "parameter 5"), ({"state": {0: {"exp_avg": torch.ones(4)}}}, "shape"),
                     ({"state": {0: {"exp_avg": torch.full((3,), float("nan"))}}}, "not finite"),
                     ({"state": {0: {"x": "text"}}}, "neither")]:
        with pytest.raises(ValueError, match=why):
            optimizer_state(bad, ours)


@pytest.mark.parametrize("make_scheduler", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=50),
    lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda e: 0.9),
])
def test_a_schedule_replayed_to_n_updates_is_where_stepping_it_n_times_gets(make_scheduler):
    def fresh():
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        return opt, make_scheduler(opt)

    stepped_opt, stepped = fresh()
    for _ in range(17):
        stepped_opt.step()
        stepped.step()
    opt, sched = fresh()
    schedule = Schedule(opt, sched)
    opt.param_groups[0]["lr"] = 1000.0  # a peer's state would have set this
    schedule.advance_to(17)
    assert sched.last_epoch == stepped.last_epoch == 17
    assert opt.param_groups[0]["lr"] == pytest.approx(stepped_opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["momentum"] == pytest.approx(stepped_opt.param_groups[0]["momentum"])


@pytest.mark.parametrize("mode", ["sync", "diloco"])
@pytest.mark.parametrize("rewrite", [True, False])
def test_gradient_rewrite_hands_the_attack_what_the_peer_averages(nodes, mode, rewrite):
    """``gradient_rewrite`` gets the tensors of each round (the mean gradient; diloco: the
    pseudo-gradient) before they are averaged: a lone peer whose attack zeroes them ends its epoch
    where it started, one without the attack does not."""
    model, opt = make(nodes(), 0, **({"mode": "diloco"} if mode == "diloco" else {}))
    rounds: list[int] = []

    def zero(tensors: list[torch.Tensor]) -> None:
        rounds.append(len(tensors))
        for t in tensors:
            t.zero_()

    try:
        if rewrite:
            MODES["gradient_rewrite"].run(opt, zero)
        before = [p.detach().clone() for p in opt.params]
        train(model, opt, 1, seed=0)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, opt.params))
        assert unchanged == rewrite
        assert rounds == ([len(opt.params)] if rewrite else [])
    finally:
        opt.close()
