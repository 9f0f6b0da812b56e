"""A small causal transformer character LM on text that ships with Python itself.

The corpus is built, not downloaded: the language-reference topics of ``pydoc_data``, a few
plain-text files of the standard library (LICENSE, idlelib's notes) and then the docstrings of
standard-library modules, in sorted path order, ASCII-filtered and cut at a fixed byte budget.
It depends only on the Python version, so peers on machines with the same Python build the same
bytes without exchanging them (:attr:`CharLMTask.signature` tells when they did not). Where those
files are missing (an embedded or stripped Python), a deterministic toy grammar fills the budget.

The vocabulary is fixed: the 128 ASCII codes, so token ids need no agreement either.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import math
import os
import random
import sysconfig
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import Batch, Task, build_config, epoch_generator

VOCAB = 128
#: corpus sources accepted by the ``corpus`` option
CORPORA = ("stdlib", "grammar")
#: the corpus is split into blocks of this many bytes; every 10th block is held out. Interleaved
#: blocks keep the validation text drawn from every source, not just the last one in the order.
SPLIT_BLOCK = 4096
_TEXT_FILES = (
    "LICENSE.txt",
    "idlelib/README.txt",
    "idlelib/HISTORY.txt",
    "idlelib/NEWS2x.txt",
    "idlelib/NEWS.txt",
    "idlelib/TODO.txt",
    "idlelib/extend.txt",
    "idlelib/CREDITS.txt",
)
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
              "lib-dynload", "turtledemo"}
# Bytes kept: tab, newline and printable ASCII; everything else (CR, other controls, non-ASCII) is
# dropped, so the text is plain and the vocab's other codes simply never occur.
_KEEP = bytes(sorted({9, 10, *range(32, 127)}))
_DROP = bytes(b for b in range(256) if b not in _KEEP)


@dataclasses.dataclass(frozen=True)
class CharLMConfig:
    context: int = 64
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    corpus: str = "stdlib"
    corpus_bytes: int = 1 << 20
    eval_tokens: int = 32768  # held-out tokens scored by evaluate(): bounds its cost

    def __post_init__(self) -> None:
        checks = (
            ("context", self.context, 2, 4096),
            ("d_model", self.d_model, 4, 8192),
            ("layers", self.layers, 1, 64),
            ("heads", self.heads, 1, 256),
            ("corpus_bytes", self.corpus_bytes, 1 << 14, 1 << 30),
            ("eval_tokens", self.eval_tokens, 1, 1 << 30),
        )
        for name, value, lo, hi in checks:
            if not lo <= value <= hi:
                raise ValueError(f"char_lm: {name} must be in {lo}..{hi}, got {value}")
        if self.d_model % self.heads:
            raise ValueError(
                f"char_lm: d_model ({self.d_model}) must be divisible by heads ({self.heads})"
            )
        if self.corpus not in CORPORA:
            raise ValueError(
                f"char_lm: corpus must be one of {', '.join(CORPORA)}, got {self.corpus!r}"
            )


# -- corpus -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    text: bytes  # ASCII
    sources: tuple[str, ...]  # where the text came from, in order

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text).hexdigest()


def ascii_clean(text: str) -> bytes:
    """Plain ASCII: CRLF -> LF, then drop every byte outside tab, newline and printable ASCII."""
    return text.replace("\r\n", "\n").encode("ascii", "ignore").translate(None, _DROP)


def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib_pieces(root: str):
    """(source label, text) in a fixed order; stops when the caller stops iterating."""
    try:
        from pydoc_data.topics import topics  # the language reference as plain text

        yield "pydoc_data.topics", "\n\n".join(topics[k] for k in sorted(topics))
    except ImportError:
        pass
    for rel in _TEXT_FILES:
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                yield f"stdlib:{rel}", f.read()
        except OSError:
            continue
    for rel in _stdlib_modules(root):
        docs = _docstrings(os.path.join(root, rel))
        if docs:
            yield f"docstrings:{rel}", "\n\n".join(docs)


def _stdlib_modules(root: str) -> list[str]:
    """Relative paths of the standard library's .py files, tests and site-packages excluded."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        found += [os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                  for f in filenames if f.endswith(".py")]
    return sorted(found)


def _docstrings(path: str) -> list[str]:
    """Docstrings of a module and its classes and functions, in source order (no import: the
    file is parsed, never executed)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    nodes = (n for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    out = []
    for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
        doc = ast.get_docstring(node)
        if doc and len(doc) >= 40:  # one-liners like "Return x." teach little and repeat a lot
            out.append(doc)
    return out


_SUBJECTS = ("the peer", "a node", "the optimizer", "each worker", "the group", "a model",
             "the swarm", "every replica", "the trainer", "a checkpoint")
_VERBS = ("sends", "averages", "stores", "fetches", "verifies", "compresses", "updates",
          "announces", "drops", "restores")
_OBJECTS = ("the gradients", "a record", "its parameters", "the manifest", "a small tensor",
            "the routing table", "each chunk", "the key", "its state", "the blob")
_ADVERBS = ("quickly", "again", "later", "at once", "in turn", "if needed", "every round")
_NAMES = ("step", "epoch", "peer", "group", "chunk", "size", "loss", "rate")


def grammar_text(n_bytes: int, seed: int = 0) -> str:
    """Deterministic pseudo-English and pseudo-code from a tiny grammar: the fallback corpus.

    It has real structure (agreement, punctuation, indentation, balanced brackets) for a model
    to learn, and depends on nothing but ``random.Random(seed)``.
    """
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        if rng.random() < 0.7:
            sentences = []
            for _ in range(rng.randint(2, 5)):
                s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
                if rng.random() < 0.4:
                    s += f" {rng.choice(_ADVERBS)}"
                if rng.random() < 0.3:
                    s += ", and " + " ".join(
                        rng.choice(words) for words in (_SUBJECTS, _VERBS, _OBJECTS)
                    )
                sentences.append(s[0].upper() + s[1:] + ".")
            para = " ".join(sentences) + "\n\n"
        else:
            a, b = rng.sample(_NAMES, 2)
            k = rng.randint(1, 99)
            para = (f"def update_{a}({a}, {b}):\n    if {a} > {k}:\n        return {a} - {b}\n"
                    f"    return ({a} + {b}) * {k}\n\n")
        parts.append(para)
        size += len(para)
    return "".join(parts)[:n_bytes]


@functools.lru_cache(maxsize=4)
def build_corpus(max_bytes: int = 1 << 20, source: str = "stdlib") -> Corpus:
    """The ASCII corpus: ``max_bytes`` bytes (exactly), the same on every call and every peer
    with the same Python. With ``source="stdlib"`` the toy grammar pads what the standard
    library does not provide; ``"grammar"`` uses the grammar alone. Cached per process."""
    if source not in CORPORA:
        raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, got {source!r}")
    chunks: list[bytes] = []
    sources: list[str] = []
    size = 0
    if source == "stdlib":
        for label, text in _stdlib_pieces(_stdlib_root()):
            data = ascii_clean(text).strip() + b"\n\n"
            if len(data) <= 2:
                continue
            chunks.append(data[: max_bytes - size])
            sources.append(label)
            size += len(chunks[-1])
            if size >= max_bytes:
                break
    if size < max_bytes:
        chunks.append(ascii_clean(grammar_text(max_bytes - size)))
        sources.append("grammar")
    return Corpus(b"".join(chunks), tuple(sources))


def split_corpus(text: bytes, block: int = SPLIT_BLOCK) -> tuple[bytes, bytes]:
    """(train, val): every 10th ``block``-byte block goes to validation (about 90/10). Blocks
    shrink for a small text so that it still has ~100 of them and the split stays ~90/10."""
    block = max(1, min(block, len(text) // 100))
    blocks = [text[i : i + block] for i in range(0, len(text), block)]
    train = b"".join(b for i, b in enumerate(blocks) if i % 10 != 9)
    val = b"".join(b for i, b in enumerate(blocks) if i % 10 == 9)
    return train, val


# -- model ------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: stable without warm-up at the small sizes used here."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, and an output layer tied to the
    token embedding. The tie is a matmul with ``tok_emb.weight``, not a second module sharing the
    tensor, so ``state_dict()`` has no aliased entries (safetensors refuses those)."""

    def __init__(self, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                # GPT-2 init; residual outputs scaled down so the stream's variance stays ~1.
                residual = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}")
        x = self.tok_emb(idx) + self.pos_emb.weight[:t]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


# -- task -------------------------------------------------------------------------------------


class CharLMTask(Task):
    """Next-character prediction; one example is a window of ``context`` + 1 bytes.

    An epoch is the set of non-overlapping windows starting at multiples of ``context``, shifted
    by an offset drawn from (seed, epoch) so that successive epochs cut the text differently.
    """

    name = "char_lm"
    # 1e-3 beat 5e-4 and 2e-3..2e-2 at 300 steps: higher rates linger on the ~2.8 plateau
    default_lr = 1e-3
    default_batch_size = 32
    default_optimizer = "adamw"
    weight_decay = 0.01

    def __init__(self, **options: object) -> None:
        self.config: CharLMConfig = build_config(CharLMConfig, self.name, options)
        self.corpus = build_corpus(self.config.corpus_bytes, self.config.corpus)
        train, val = split_corpus(self.corpus.text)
        ctx = self.config.context
        self._num_train = len(train) // ctx - 1  # room for any offset < ctx plus the last target
        n_val = (len(val) - 1) // ctx
        if self._num_train < 1 or n_val < 1:
            raise ValueError(
                f"char_lm: corpus_bytes={self.config.corpus_bytes} is too small for context={ctx}"
            )
        self.train_data = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        self.val_data = torch.frombuffer(bytearray(val), dtype=torch.uint8)
        # Evenly spaced held-out windows, at most eval_tokens tokens in all: a fixed, cheap probe.
        n_eval = max(1, min(n_val, self.config.eval_tokens // ctx))
        starts = torch.linspace(0, n_val - 1, n_eval).round().long() * ctx
        self._eval_windows = self.val_data[starts[:, None] + torch.arange(ctx + 1)].long()

    @property
    def num_train(self) -> int:
        return self._num_train

    def _offset(self, seed: int, epoch: int) -> int:
        g = epoch_generator(seed, -1 - epoch)  # a stream apart from the shuffles'
        return int(torch.randint(self.config.context, (1,), generator=g))

    def train_batch(self, indices: Tensor, *, seed: int, epoch: int) -> Batch:
        ctx = self.config.context
        starts = indices * ctx + self._offset(seed, epoch)
        w = self.train_data[starts[:, None] + torch.arange(ctx + 1)].long()
        return w[:, :-1], w[:, 1:]

    def record_batches(self, records: Iterator[Any], batch_size: int) -> Iterator[Batch]:
        """Consecutive windows of ``context + 1`` bytes of text records (ASCII-cleaned, as the
        built-in corpus), ``batch_size`` windows a batch: each record is read once."""
        width = self.config.context + 1
        need = width * batch_size
        buf = bytearray()
        for rec in records:
            buf += ascii_clean(rec.decode("utf-8", "replace")) if isinstance(rec, bytes) else bytes(rec.tolist())
            while len(buf) >= need:
                w = torch.frombuffer(bytearray(buf[:need]), dtype=torch.uint8).long().view(batch_size, width)
                del buf[:need]
                yield w[:, :-1], w[:, 1:]

    def _build_model(self) -> nn.Module:
        c = self.config
        return CharTransformer(c.context, c.d_model, c.layers, c.heads)

    def _data_digest(self) -> bytes:
        return bytes.fromhex(self.corpus.digest)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        device = next(model.parameters()).device
        try:
            for w in self._eval_windows.split(64):
                w = w.to(device)
                logits = model(w[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
                total += loss.item()
                count += w[:, 1:].numel()
        finally:
            model.train(was_training)
        mean = total / count
        return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}
