"""Training tasks: deterministic models and data, sharding, convergence, errors."""

from __future__ import annotations

import math

import pytest
import torch

from p2ptrain.tasks import TASKS, Task, get_task, train_single
from p2ptrain.tasks import char_lm as char_lm_mod
from p2ptrain.tasks.char_lm import build_corpus, grammar_text, split_corpus

# Small enough that every char_lm test here runs in a second or two on 2 cores.
SMALL_LM = {
    "context": 32, "d_model": 64, "layers": 2, "heads": 4,
    "corpus_bytes": 1 << 18, "eval_tokens": 8192,
}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are too small to gain from two, and with other processes
    busy on a 2-core machine, two threads (OpenMP spin-waits) ran the short char_lm run 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits() -> Task:
    return get_task("digits")


@pytest.fixture(scope="module")
def lm() -> Task:
    return get_task("char_lm", **SMALL_LM)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fixture", ["digits", "lm"])
def test_same_seed_same_model(fixture: str, request: pytest.FixtureRequest) -> None:
    task: Task = request.getfixturevalue(fixture)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = _params(task.make_model(7)), _params(task.make_model(7)), _params(task.make_model(8))
    # make_model neither depends on nor disturbs the global RNG
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_state_dict_has_no_aliased_tensors(lm: Task) -> None:
    """safetensors refuses state dicts whose entries share storage (e.g. naively tied weights)."""
    sd = lm.make_model().state_dict()
    ptrs = [t.untyped_storage().data_ptr() for t in sd.values()]
    assert len(set(ptrs)) == len(ptrs)


@pytest.mark.parametrize("fixture", ["digits", "lm"])
def test_ranks_split_each_epoch_disjointly(fixture: str, request: pytest.FixtureRequest) -> None:
    task: Task = request.getfixturevalue(fixture)
    for epoch in (0, 1):
        shards = [task.epoch_indices(epoch, seed=3, rank=r, world=4) for r in range(4)]
        joined = torch.cat(shards)
        assert len(joined) == task.num_train  # disjoint ...
        assert torch.equal(joined.sort().values, torch.arange(task.num_train))  # ... and covering
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    # reshuffled per epoch, reproducible from the seed, different for another seed
    e0 = task.epoch_indices(0, seed=3)
    assert torch.equal(e0, task.epoch_indices(0, seed=3))
    assert not torch.equal(e0, task.epoch_indices(1, seed=3))
    assert not torch.equal(e0, task.epoch_indices(0, seed=4))


def test_digits_batches_follow_the_shards(digits: Task) -> None:
    bs, world = 32, 4
    seen = []
    for rank in range(world):
        idx = digits.epoch_indices(0, seed=1, rank=rank, world=world)
        it = digits.batches(bs, seed=1, rank=rank, world=world)
        n_batches = -(-len(idx) // bs)  # the last batch of an epoch may be short, not dropped
        xs, ys = zip(*(next(it) for _ in range(n_batches)))
        assert torch.equal(torch.cat(ys), digits.y_train[idx])
        assert torch.equal(torch.cat(xs), digits.x_train[idx])
        seen.append(idx)
        # the next batch starts epoch 1
        x1, _ = next(it)
        idx1 = digits.epoch_indices(1, seed=1, rank=rank, world=world)
        assert torch.equal(x1, digits.x_train[idx1[:bs]])
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(digits.num_train))


def test_char_lm_batches_are_shifted_windows(lm: Task) -> None:
    ctx = lm.config.context
    x, y = next(lm.batches(8, seed=0, rank=1, world=2))
    assert x.shape == y.shape == (8, ctx) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert int(x.max()) < 128
    starts = lm.epoch_indices(0, seed=0, rank=1, world=2)[:8] * ctx
    data = lm.train_data.long()
    offsets = {
        next(o for o in range(ctx) if torch.equal(data[s + o : s + o + ctx], row))
        for s, row in zip(starts.tolist(), x)
    }
    assert len(offsets) == 1  # one offset per epoch, shared by the ranks: windows stay disjoint


def test_digits_single_process_reaches_95_percent(digits: Task) -> None:
    result = train_single(digits, steps=300, batch_size=32, seed=0)  # ~0.2 s unloaded
    assert result["accuracy"] >= 0.95, result
    # short epoch-end batches count what they hold
    assert 300 * 32 - 32 * (300 * 32 // digits.num_train + 1) < result["samples"] <= 300 * 32
    assert result["seconds"] < 10


def test_digits_stop_when_counts_samples(digits: Task) -> None:
    result = train_single(digits, steps=2000, batch_size=32, log_every=5,
                          stop_when=lambda m: m["accuracy"] >= 0.95)
    assert result["accuracy"] >= 0.95
    assert result["steps"] < 2000
    assert result["history"][-1]["samples"] == result["samples"]


def test_char_lm_loss_decreases(lm: Task) -> None:
    start = lm.evaluate(lm.make_model(0))
    assert start["loss"] == pytest.approx(math.log(128), abs=0.1)
    result = train_single(lm, steps=100, batch_size=16, seed=0)  # ~2.5 s unloaded
    assert result["loss"] < start["loss"] - 1.5, (start, result)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-6)


def test_evaluate_keys_and_mode(digits: Task, lm: Task) -> None:
    for task, keys in ((digits, {"loss", "accuracy"}), (lm, {"loss", "perplexity"})):
        model = task.make_model()
        model.train()
        assert set(task.evaluate(model)) == keys
        assert model.training  # evaluate() restores the mode it found
        model.eval()
        task.evaluate(model)
        assert not model.training


def test_corpus_is_deterministic_ascii() -> None:
    build = build_corpus.__wrapped__  # bypass the per-process cache
    a, b = build(1 << 18, "stdlib"), build(1 << 18, "stdlib")
    assert a.text == b.text and a.sources == b.sources
    assert len(a.text) == 1 << 18
    assert set(a.text) <= {9, 10, *range(32, 127)}
    assert a.sources[0] == "pydoc_data.topics"  # the stdlib is present on this interpreter
    train, val = split_corpus(a.text)
    assert len(train) + len(val) == len(a.text)
    assert 0.08 < len(val) / len(a.text) < 0.12
    g = build(1 << 16, "grammar")
    assert g.text == build(1 << 16, "grammar").text and len(g.text) == 1 << 16
    assert g.sources == ("grammar",) and set(g.text) <= {9, 10, *range(32, 127)}


def test_corpus_falls_back_to_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(char_lm_mod, "_stdlib_pieces", lambda root: iter(()))
    c = build_corpus.__wrapped__(1 << 16, "stdlib")
    assert c.sources == ("grammar",)
    assert c.text == grammar_text(1 << 16).encode()


def test_signature_tracks_options_and_data(lm: Task) -> None:
    assert lm.signature == get_task("char_lm", **SMALL_LM).signature
    assert lm.signature.startswith("char_lm-")
    assert lm.signature != get_task("char_lm", **{**SMALL_LM, "d_model": 32}).signature
    assert lm.signature != get_task("char_lm", **{**SMALL_LM, "corpus": "grammar"}).signature


def test_unknown_task_lists_choices() -> None:
    with pytest.raises(ValueError, match="choose one of: digits, char_lm"):
        get_task("mnist")
    assert set(TASKS) == {"digits", "char_lm"}
    assert get_task("char-lm", **SMALL_LM).name == "char_lm"


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("digits", {"hiden": 64}, "unknown option.*hiden.*valid: hidden=128"),
        ("digits", {"hidden": 0}, "hidden must be in"),
        ("digits", {"hidden": 1.5}, "expected int"),
        ("digits", {"hidden": "abc"}, "expected int"),
        ("char_lm", {"d_model": 60, "heads": 8}, "divisible by heads"),
        ("char_lm", {"context": 1}, "context must be in"),
        ("char_lm", {"corpus": "web"}, "corpus must be one of"),
        ("char_lm", {"corpus_bytes": 100}, "corpus_bytes must be in"),
        ("char_lm", {"context": 4096, "corpus_bytes": 1 << 14}, "too small for context"),
        ("char_lm", {"context": 2048, "corpus_bytes": 1 << 14}, "too small for context"),
    ],
)
def test_bad_options_are_explained(name: str, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_task(name, **options)


def test_string_options_are_converted() -> None:
    """The CLI passes ``key=value`` strings straight through."""
    task = get_task("digits", hidden="64", depth="1")
    assert task.options == {"hidden": 64, "depth": 1}


def test_bad_arguments_are_explained(digits: Task) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        digits.batches(0)
    with pytest.raises(ValueError, match="rank < world"):
        digits.batches(8, rank=4, world=4)
    with pytest.raises(ValueError, match="exceeds"):
        digits.batches(8, rank=0, world=10**6)
    with pytest.raises(ValueError, match="unknown optimizer"):
        digits.make_optimizer(digits.make_model().parameters(), name="lion")
    with pytest.raises(ValueError, match="learning rate"):
        digits.make_optimizer(digits.make_model().parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        lm_model = get_task("char_lm", **SMALL_LM).make_model()
        lm_model(torch.zeros(1, SMALL_LM["context"] + 1, dtype=torch.long))


def test_make_optimizer_defaults(digits: Task) -> None:
    opt = digits.make_optimizer(digits.make_model().parameters())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["lr"] == digits.default_lr
    sgd = digits.make_optimizer(digits.make_model().parameters(), lr=0.1, name="sgd")
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["lr"] == 0.1
