"""The optimizer and the averager with models and tensors on a CUDA device.

Skipped without CUDA (CI has none). ``P2PTRAIN_TEST_DEVICE=cpu`` runs the same checks on the CPU,
which is how they are kept honest on machines without a GPU; on a GPU machine they run as written.
They check what only a device exercises: the state and gradients that cross between the device and
the fp32 CPU buffers the wire needs, AMP's GradScaler with real fp16 autocast, a joiner whose model
lives on the device loading the swarm's state, and a CPU peer and a device peer averaging together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from p2ptrain import DecentralizedOptimizer
from p2ptrain.averaging import BlockingAverager
from test_optimizer import in_threads, swarm  # noqa: F401 - swarm is a fixture

DEVICE = torch.device(os.environ.get("P2PTRAIN_TEST_DEVICE", "cuda"))

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"),
]

W_TRUE = torch.arange(8, dtype=torch.float32).reshape(8, 1) / 8


def make_model(device: torch.device = DEVICE, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model.to(device)


def batch(gen: torch.Generator, device: torch.device = DEVICE, bs: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(bs, 8, generator=gen)
    return x.to(device), (x @ W_TRUE).to(device)


def eval_loss(model: torch.nn.Module) -> float:
    device = next(model.parameters()).device
    with torch.no_grad():
        x, y = batch(torch.Generator().manual_seed(99), device, 256)
        return float(torch.nn.functional.mse_loss(model(x), y))


def amp_train(opt: DecentralizedOptimizer, model: torch.nn.Module, gen: torch.Generator, until_epoch: int) -> None:
    """Mixed precision as the PyTorch AMP recipe has it: autocast, scaled loss, unscale, clip, step."""
    device = next(model.parameters()).device
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    steps = 0
    while opt.epoch < until_epoch and steps < 2000:
        x, y = batch(gen, device)
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        steps += 1


def test_alone_on_the_device_equals_plain_gradient_accumulation(swarm):  # noqa: F811
    model, ref = make_model(), make_model()
    opt = DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), dht=swarm(), run_id="dev-alone",
                                 target_batch_size=64, batch_size_per_step=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    try:
        for step in range(12):
            x, y = batch(g1)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            x, y = batch(g2)
            (torch.nn.functional.mse_loss(ref(x), y) / 4).backward()
            if step % 4 == 3:
                ref_opt.step()
                ref_opt.zero_grad()
        assert opt.epoch == 3
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.device.type == DEVICE.type
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for state in opt.inner.state.values():
            assert state["exp_avg"].device.type == DEVICE.type
    finally:
        opt.close()


def test_two_device_peers_with_amp_and_clipping_take_identical_steps(swarm):  # noqa: F811
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="dev-amp",
                                   target_batch_size=256, batch_size_per_step=16, compression="int8",
                                   scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
            for m, d in zip(models, dhts)]
    try:
        assert opts[0].wait_for_peers(2, timeout=20) == 2 and opts[1].wait_for_peers(2, timeout=20) == 2
        first = eval_loss(models[0])
        gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
        in_threads(*(lambda i=i: amp_train(opts[i], models[i], gens[i], 4) for i in range(2)))
        assert [o.epoch for o in opts] == [4, 4]
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert p.device.type == DEVICE.type
            assert torch.equal(p, q), "peers of one group must end bit-identical"
        assert opts[0].stats.last_group_size == 2 and opts[0].stats.bytes_sent > 0
        assert opts[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**2)
        assert eval_loss(models[0]) < first
    finally:
        for o in opts:
            o.close()


def test_joiner_on_the_device_loads_a_cpu_swarm_state_and_they_average_together(swarm):  # noqa: F811
    """A CPU peer trains; a device peer joins, takes its state, and the two then step as one."""
    cpu_model = make_model(torch.device("cpu"))
    cpu_opt = DecentralizedOptimizer(torch.optim.AdamW(cpu_model.parameters(), lr=1e-2), dht=swarm(),
                                     run_id="dev-mixed", target_batch_size=64, batch_size_per_step=16)
    dev_opt = None
    try:
        gen = torch.Generator().manual_seed(3)
        while cpu_opt.epoch < 2:
            x, y = batch(gen, torch.device("cpu"))
            torch.nn.functional.mse_loss(cpu_model(x), y).backward()
            cpu_opt.step()
            cpu_opt.zero_grad()
        dev_model = make_model(seed=7)
        dev_opt = DecentralizedOptimizer(torch.optim.AdamW(dev_model.parameters(), lr=1e-2), dht=swarm(),
                                         run_id="dev-mixed", target_batch_size=64, batch_size_per_step=16)
        assert dev_opt.stats.state_loads == 1 and dev_opt.epoch == 2
        for p, q in zip(dev_model.parameters(), cpu_model.parameters()):
            assert p.device.type == DEVICE.type
            assert torch.equal(p.cpu(), q)
        for k, state in cpu_opt.inner.state_dict()["state"].items():
            joined = dev_opt.inner.state_dict()["state"][k]
            assert joined["exp_avg"].device.type == DEVICE.type
            assert torch.equal(joined["exp_avg_sq"].cpu(), state["exp_avg_sq"])

        assert cpu_opt.wait_for_peers(2, timeout=20) == 2 and dev_opt.wait_for_peers(2, timeout=20) == 2
        gens = [torch.Generator().manual_seed(40 + i) for i in range(2)]

        def run(opt, model, g):
            device = next(model.parameters()).device
            while opt.epoch < 5:
                x, y = batch(g, device)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()

        in_threads(lambda: run(cpu_opt, cpu_model, gens[0]), lambda: run(dev_opt, dev_model, gens[1]))
        assert cpu_opt.stats.rounds >= 1 and dev_opt.stats.rounds >= 1
        # the same averaged gradient, applied by AdamW on two devices: equal up to kernel rounding
        for p, q in zip(dev_model.parameters(), cpu_model.parameters()):
            torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    finally:
        for o in (cpu_opt, dev_opt):
            if o is not None:
                o.close()


def test_diloco_on_the_device_keeps_peers_identical(swarm):  # noqa: F811
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    start = [p.detach().clone() for p in models[0].parameters()]
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="dev-dl",
                                   mode="diloco", local_steps=5, batch_size_per_step=16, compression="int8")
            for m, d in zip(models, dhts)]
    try:
        assert opts[0].wait_for_peers(2, timeout=20) == 2 and opts[1].wait_for_peers(2, timeout=20) == 2
        gens = [torch.Generator().manual_seed(30 + i) for i in range(2)]
        in_threads(*(lambda i=i: amp_train(opts[i], models[i], gens[i], 3) for i in range(2)))
        assert [o.epoch for o in opts] == [3, 3]
        for p, q, s in zip(models[0].parameters(), models[1].parameters(), start):
            assert p.device.type == DEVICE.type
            assert torch.equal(p, q)
        assert any(not torch.equal(p, s) for p, s in zip(models[0].parameters(), start))
        sd = opts[0].state_dict()
        opts[0].load_state_dict(sd)
        assert opts[0].epoch == 3
        assert all(p.device.type == DEVICE.type for p in models[0].parameters())
    finally:
        for o in opts:
            o.close()


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_averager_with_device_tensors_of_mixed_dtypes(codec):
    a = {"w": torch.full((1000,), 1.0, device=DEVICE), "h": torch.full((64,), 2.0, device=DEVICE, dtype=torch.bfloat16)}
    b = {"w": torch.full((1000,), 3.0, device=DEVICE), "h": torch.full((64,), 4.0, device=DEVICE, dtype=torch.bfloat16)}
    first = BlockingAverager(a, "dev-avg", codec=codec, matchmaking_timeout=3.0)
    try:
        boot = [str(m) for m in first.dht.multiaddrs]
        second = BlockingAverager(b, "dev-avg", initial_peers=boot, codec=codec, matchmaking_timeout=3.0)
        try:
            results = {}
            thread = threading.Thread(target=lambda: results.setdefault("a", first.step(weight=1.0)))
            thread.start()
            results["b"] = second.step(weight=3.0)
            thread.join(30)
            assert results["a"].group_size == results["b"].group_size == 2
            for t in (a, b):
                assert t["w"].device.type == DEVICE.type and t["h"].dtype == torch.bfloat16
                torch.testing.assert_close(t["w"].cpu(), torch.full((1000,), 2.5), rtol=0, atol=0.02)
                torch.testing.assert_close(t["h"].float().cpu(), torch.full((64,), 3.5), rtol=0, atol=0.02)
        finally:
            second.close()
    finally:
        first.close()


EXAMPLES = Path(__file__).parent.parent / "examples"


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_examples_train_on_the_device():
    out = subprocess.run([sys.executable, str(EXAMPLES / "digits_mlp.py"), "--json", "--epochs", "8",
                          "--device", str(DEVICE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _events(out.stdout)[-1]["accuracy"] > 0.5
    out = subprocess.run([sys.executable, str(EXAMPLES / "char_lm.py"), "--json", "--epochs", "1", "--local-steps", "4",
                          "--batch-size", "8", "--device", str(DEVICE)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    done = _events(out.stdout)[-1]
    assert done["event"] == "done" and done["perplexity"] > 1 and isinstance(done["sample"], str)


def test_cli_swarm_trains_on_the_device(tmp_path, child_pids):
    before = child_pids()
    out = subprocess.run([sys.executable, "-m", "p2ptrain", "swarm", "--peers", "2", "--epochs", "10", "--json",
                          "--device", str(DEVICE), "--out", str(tmp_path)], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    done = [e for e in _events(out.stdout) if e["event"] == "done"]
    assert sorted(e["peer"] for e in done) == [0, 1]
    assert all(e["epoch"] == 10 and e["rounds"] > 0 and e["metrics"]["accuracy"] > 0.5 for e in done)
    assert child_pids() <= before
