"""DiLoCo with ``overlap_outer``: the outer round of epoch t runs while the inner steps of t+1
proceed; peers still agree on the outer parameters after every round, and joiners catch up."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from p2ptrain import DecentralizedOptimizer
from p2ptrain.optim import diloco_step
from p2ptrain.optim.outer_swap import eager_start, land_overlapped
from test_optimizer import batch, in_threads, loss_of, make_model, swarm, train  # noqa: F401 - swarm is a fixture


def overlapped(model: torch.nn.Module, dht, run_id: str, **kw) -> DecentralizedOptimizer:
    return DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), dht=dht, run_id=run_id,
                                  mode="diloco", local_steps=5, batch_size_per_step=16, compression="none",
                                  overlap_outer=True, average_state_every=0, **kw)


def test_a_round_starts_eagerly_and_lands_with_a_merge():
    """The parameters start the next round where the outer step takes the outer ones with our
    own pseudo-gradient (Nesterov SGD, momentum included), and keep ``mix`` of how far they are
    from the outer parameters once the real step is taken."""
    outer, params, out = [torch.tensor([1.0, 2.0])], [torch.tensor([0.0, 5.0])], [torch.empty(2)]
    outer_opt = torch.optim.SGD(outer, lr=0.5, momentum=0.5, nesterov=True)
    outer[0].grad = torch.tensor([2.0, 0.0])
    outer_opt.step()  # (a momentum buffer to take along: [2, 0]; outer is now [-0.5, 2])
    ref = [outer[0].clone()]
    ref_opt = torch.optim.SGD(ref, lr=0.5, momentum=0.5, nesterov=True)
    ref_opt.load_state_dict(outer_opt.state_dict())
    eager_start(outer, params, out, outer_opt)
    assert torch.equal(out[0], torch.tensor([-0.5, -3.0]))
    ref[0].grad = out[0].clone()
    ref_opt.step()
    torch.testing.assert_close(params[0], ref[0])  # where the step with our own would take us
    params[0] += torch.tensor([0.25, 0.0])  # a step of our own meanwhile

    def step() -> None:  # the group's average: twice ours
        outer[0].grad = 2 * out[0]
        outer_opt.step()

    land_overlapped(params, outer, 0.25, step)
    assert not torch.equal(outer[0], ref[0])
    torch.testing.assert_close(params[0], outer[0] + 0.25 * (ref[0] + torch.tensor([0.25, 0.0]) - outer[0]))


def test_alone_overlapped_rounds_are_blocking_diloco(swarm):  # noqa: F811
    """A lone peer's round lands before its next inner step, which has taken nothing since the
    round started: it trains exactly as a blocking peer does."""
    models = [make_model(), make_model()]
    opts = [DecentralizedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), dht=swarm(), run_id=f"alone{i}",
                                   mode="diloco", local_steps=3, batch_size_per_step=16, overlap_outer=i == 1)
            for i, m in enumerate(models)]
    try:
        for opt, model in zip(opts, models):
            gen = torch.Generator().manual_seed(5)
            assert train(opt, model, gen, 3) == 9
            opt.finish_round()
        assert opts[1].stats.overlapped_steps == 0  # (alone: no round to wait for)
        for p, q in zip(*(m.parameters() for m in models)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for o, q in zip(opts[1]._outer, opts[0]._outer):
            torch.testing.assert_close(o, q, rtol=1e-5, atol=1e-6)
        held = opts[1].memory_report()  # outer parameters, their momentum and the averaging buffer
        fp32 = 4 * sum(p.numel() for p in models[1].parameters())
        assert held["outer parameters"] == held["outer optimizer state"] == held["averaging buffer"] == fp32
    finally:
        for o in opts:
            o.close()


def test_two_overlapping_peers_train_during_rounds_and_agree_after_each(swarm, monkeypatch):  # noqa: F811
    """Round 0 is held back on the event loop: both peers take inner steps while it is in
    flight; every round then lands with the same outer parameters on both."""
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    start = [p.detach().clone() for p in models[0].parameters()]
    opts = [overlapped(m, d, "ov") for m, d in zip(models, dhts)]
    # (a peer held at the barrier below would, by its published end of its phase, end the other's
    # phase before that one reached the barrier: the peers publish none here)
    monkeypatch.setattr(diloco_step, "inner_eta", lambda opt, bs=None: None)
    gate, in_flight = threading.Event(), threading.Barrier(2, timeout=30)
    for opt in opts:
        real = opt.averager.step

        async def held(real=real, **kw):
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 30)
            return await real(**kw)

        opt.averager.step = held
    outers: list[dict[int, list[torch.Tensor]]] = [{}, {}]
    for opt, seen in zip(opts, outers):  # (called once each round's update is in)
        opt._maybe_average_state = lambda epoch, opt=opt, seen=seen: seen.setdefault(
            opt._applied, [t.clone() for t in opt._outer]) is None

    def peer(i: int) -> None:
        opt, model, gen = opts[i], models[i], torch.Generator().manual_seed(30 + i)
        train(opt, model, gen, 1)
        at_boundary = [p.detach().clone() for p in model.parameters()]
        while opt.stats.overlapped_steps < 3:
            loss_of(model, batch(gen)).backward()
            opt.step()
            opt.zero_grad()
        assert opt._applied == 0 and opt._pending is not None and not opt._pending.done()
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), at_boundary))
        in_flight.wait()
        gate.set()
        while opt.epoch < 4 or opt._pending is not None:
            loss_of(model, batch(gen)).backward()
            opt.step()
            opt.zero_grad()
            if opt.epoch == 4:
                opt.finish_round()

    opts[0].wait_for_peers(2, timeout=20)
    opts[1].wait_for_peers(2, timeout=20)
    in_threads(lambda: peer(0), lambda: peer(1))
    assert [o._applied for o in opts] == [4, 4]
    assert sorted(outers[0]) == sorted(outers[1]) == [1, 2, 3, 4]  # (each landed round seen)
    for k in outers[0]:
        for a, b in zip(outers[0][k], outers[1][k]):
            assert torch.equal(a, b), f"outer parameters differ after round {k}"
    for p, q, s in zip(models[0].parameters(), models[1].parameters(), start):
        assert torch.equal(p, q) and not torch.equal(p, s)
    assert all(o.stats.last_group_size == 2 and o.stats.failed_rounds == 0 for o in opts)
    for o in opts:
        o.close()


def test_a_joiner_catches_up_with_overlapping_peers_and_averages_with_them(swarm):  # noqa: F811
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    opts = [overlapped(m, d, "ovj") for m, d in zip(models, dhts)]
    joiner = None
    try:
        opts[0].wait_for_peers(2, timeout=20)
        opts[1].wait_for_peers(2, timeout=20)
        gens = [torch.Generator().manual_seed(50 + i) for i in range(3)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 2) for i in range(2)))
        for o in opts:
            o.finish_round()
        late = make_model(seed=7)
        joiner = overlapped(late, swarm(), "ovj")
        assert joiner.epoch == 2 and joiner._applied == 2 and joiner.stats.state_loads == 1
        for o, q, p in zip(joiner._outer, opts[0]._outer, late.parameters()):
            assert torch.equal(o, q) and torch.equal(p, q)
        everyone = [*opts, joiner]
        models.append(late)
        for o in everyone:  # (rounds of a few ms: a view without the joiner would leave it out of them)
            assert o.wait_for_peers(3, timeout=20) == 3

        def more(i: int) -> None:
            train(everyone[i], models[i], gens[i], 4)
            everyone[i].finish_round()

        in_threads(*(lambda i=i: more(i) for i in range(3)))
        assert [o._applied for o in everyone] == [4, 4, 4]
        assert joiner.stats.rounds >= 1 and joiner.stats.last_group_size >= 2
        for o, q in zip(joiner._outer, opts[0]._outer):
            assert torch.equal(o, q)
    finally:
        for o in [*opts, joiner]:
            if o is not None:
                o.close()


def test_overlap_is_for_diloco_and_part_of_the_schema(swarm):  # noqa: F811
    dht = swarm()
    with pytest.raises(ValueError, match="overlap_outer is for diloco"):
        DecentralizedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), dht=dht, run_id="x",
                               overlap_outer=True)
    a = overlapped(make_model(), dht, "sch")
    b = DecentralizedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), dht=dht, run_id="sch2",
                               mode="diloco", compression="none")
    try:
        assert a.averager.schema.hash != b.averager.schema.hash  # blocking and overlapped peers never meet
        assert a.averager.schema.codec == "none/overlap"
    finally:
        a.close()
        b.close()
