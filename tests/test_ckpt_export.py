"""Checkpoints a user can load: a trainer's checkpoint exports under its model's state_dict names
(buffers, frozen and tied weights included), optimizer state only on request, and older
checkpoints without names still export (positionally, with a note)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dht import Identity
from p2ptrain.checkpoint import build_snapshot
from p2ptrain.checkpoint.store import CheckpointStore

CLI = [sys.executable, "-m", "p2ptrain"]


class Net(torch.nn.Module):
    """Everything a state_dict holds besides trained parameters: BatchNorm buffers, a frozen
    layer, and an output layer tied to the embedding (one parameter under two keys)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(10, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.bn(self.emb(x))))


def train(tmp_path, mode: str, seed: int = 0, epochs: int = 4, named: bool = True):
    """A lone peer trains ``Net`` with checkpoints every 2 epochs; returns (model, optimizer stats).
    ``named=False``: the optimizer is not told its model (as before checkpoints recorded names)."""
    from p2ptrain import DHT, DecentralizedOptimizer

    model = Net(seed)
    dht = DHT([])
    try:
        opt = DecentralizedOptimizer(
            torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05), dht=dht,
            run_id=f"export-{mode}", mode=mode, local_steps=2, target_batch_size=16, batch_size_per_step=16,
            checkpoint_every=2, checkpoint_dir=tmp_path / "data", model=model if named else None)
        gen = torch.Generator().manual_seed(1)
        try:
            while opt.epoch < epochs:
                x = torch.randint(0, 10, (16,), generator=gen)
                torch.nn.functional.cross_entropy(model(x), x).backward()
                opt.step()
                opt.zero_grad()
                opt.checkpointer.flush(30)  # epochs take milliseconds here; a due save would be skipped
        finally:
            opt.close()
        return model, opt.stats
    finally:
        dht.close()


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_a_trainers_checkpoint_exports_what_load_state_dict_takes(tmp_path, mode):
    model, stats = train(tmp_path, mode)
    assert stats.last_checkpoint_epoch == 4
    store = CheckpointStore(tmp_path / "data")
    info = store.latest(f"export-{mode}")
    assert info.epoch == 4
    out = tmp_path / "model.safetensors"
    count, note = store.export(info.manifest_id, out)
    assert note is None and count == len(model.state_dict())
    fresh = Net(seed=7)
    fresh.load_state_dict(load_file(out), strict=True)  # every key, nothing else, right shapes
    model.eval(), fresh.eval()
    x = torch.arange(10)
    assert torch.equal(fresh(x), model(x))
    assert torch.equal(fresh.bn.running_mean, model.bn.running_mean)  # buffers came along
    assert fresh.bn.num_batches_tracked.item() == model.bn.num_batches_tracked.item() > 0

    with_opt = tmp_path / "with-optimizer.safetensors"
    count, _ = store.export(info.manifest_id, with_opt, with_optimizer=True)
    names = set(load_file(with_opt))
    extra = names - set(model.state_dict())
    prefix = "optimizer.state." if mode == "sync" else "outer_optimizer.state."
    assert extra and all(n.startswith(prefix) for n in extra), sorted(extra)
    assert count == len(names)

    if mode == "sync":  # `ckpt show` names the tensors as export does
        run = subprocess.run([*CLI, "ckpt", "show", info.cid, "--json", "--data-dir", str(tmp_path / "data")],
                             capture_output=True, text=True, timeout=60)
        shown = {t["name"]: t.get("aliases", []) for t in json.loads(run.stdout)["tensors"]}
        assert shown["emb.weight"] == ["head.weight"] and "bn.running_mean" in shown, shown
        assert "optimizer.state.0.exp_avg" in shown and not any(n.startswith("params.") for n in shown)


def test_resuming_from_a_checkpoint_restores_the_models_buffers(tmp_path):
    model, _ = train(tmp_path, "sync")
    resumed, stats = train(tmp_path, "sync", seed=3, epochs=4)  # starts at 4: trains no step
    assert stats.resumed_epoch == 4
    for name, t in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name


def test_a_checkpoint_without_names_or_buffers_still_resumes_a_trainer_given_its_model(tmp_path):
    model, _ = train(tmp_path, "sync", named=False)
    resumed, stats = train(tmp_path, "sync", seed=3, epochs=4)
    assert stats.resumed_epoch == 4
    assert torch.equal(resumed.emb.weight, model.emb.weight) and torch.equal(resumed.bn.bias, model.bn.bias)
    assert torch.equal(resumed.bn.running_mean, Net(3).bn.running_mean)  # none saved: its own are kept


def test_a_model_the_optimizer_does_not_train_is_refused():
    from p2ptrain import DecentralizedOptimizer

    trained, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="model= must be the module the optimizer trains"):
        DecentralizedOptimizer(torch.optim.SGD(trained.parameters(), lr=0.1), run_id="r", model=other)


def old_style_checkpoint(store: CheckpointStore) -> str:
    """What an optimizer saved before checkpoints recorded names: parameters by position."""
    w, b = torch.randn(4, 3), torch.randn(4)
    inner = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)},
                       1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    m, buffer = build_snapshot({"params": [w, b], "inner": inner}, meta={"mode": "sync", "schema": "ab", "epoch": 3})
    return store.save(m, buffer, run_id="old", epoch=3, identity=Identity()).cid


def test_a_checkpoint_without_names_still_exports_and_says_so(tmp_path):
    data = tmp_path / "store"
    cid = old_style_checkpoint(CheckpointStore(data))
    out = tmp_path / "old.safetensors"
    run = subprocess.run([*CLI, "ckpt", "export", cid, str(out), "--data-dir", str(data)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(notes) == 1 and notes[0].startswith("note: ") and "params.0" in notes[0], run.stderr
    assert sorted(load_file(out)) == ["params.0", "params.1"]  # the model only: no optimizer state unasked
    assert "wrote" in run.stdout and "2 tensors" in run.stdout

    run = subprocess.run([*CLI, "ckpt", "export", "--with-optimizer", cid, str(out), "--data-dir", str(data)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "inner.state.0.exp_avg" in load_file(out) and len(load_file(out)) == 6


def test_names_a_manifest_claims_are_checked_against_its_tensors():
    from p2ptrain.checkpoint.export import export_plan

    state = {"params": [torch.zeros(2), torch.ones(3)]}
    good, _ = build_snapshot(state, meta={"state_dict": {"a.weight": "params.0", "b.weight": "params.1"}})
    assert export_plan(good) == ([("a.weight", 0), ("b.weight", 1)], None)
    many = {f"k{i}": "params.1" for i in range(9)}  # one tensor, nine copies in the file: not a model
    for bad in ({"a.weight": "params.7"}, {"a.weight": 0}, ["params.0"], {"": "params.0"}, many):
        m, _ = build_snapshot(state, meta={"state_dict": bad})
        plan, note = export_plan(m)
        assert plan == [("params.0", 0), ("params.1", 1)] and note, bad
    clash, _ = build_snapshot({"params": [torch.zeros(1)], "inner": {"state": {0: {"x": torch.zeros(1)}}}},
                              meta={"state_dict": {"optimizer.state.0.x": "params.0"}})
    with pytest.raises(ValueError, match="'optimizer.state.0.x'"):
        export_plan(clash, with_optimizer=True)
