"""What ``ckpt_finetune`` fine-tunes: the model, the two corpora, the cached pre-trained base,
and the skew statistic computed from actual per-layer weight deltas.

- Model: a 12-layer Llama, hidden 128 (2.4M parameters, 15 checkpoint groups), byte vocabulary:
  deep enough for the "< 30% of the layers" question to have an answer finer than 1 of 3.
- Pre-training corpus: the Python standard library's source in its sorted order
  (``train.data.corpus_tokens``: ``__future__``, ``_collections_abc``, ``abc``, ``argparse``...).
- Fine-tuning corpus: instruction-format records built from the *other end* of the standard
  library (files in reverse sorted order: ``zoneinfo``, ``zipfile``, ``xml``, ``wsgiref``...):
  ``### Instruction: Explain `module.function(args)`. ### Response: <its docstring's first
  paragraph>``. English prose in a fixed template, where pre-training saw code: a shift of
  both domain and format, as a chat/instruction fine-tune of a code-pretrained model is.
  Every 20th record is held out for eval.
- The base is pre-trained once per (model, schedule, interpreter, torch) and cached under
  ``benchmarks/.cache/`` (git-ignored); nothing is downloaded.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from layerwise.models.names import group_of, layer_index
from layerwise.models.registry import FAMILIES
from layerwise.train.data import batches, corpus_tokens, stdlib_files
from layerwise.train.tokenizer import ByteTokenizer
from layerwise.util.atomic import atomic_write, atomic_write_text

CACHE_DIR = Path(__file__).resolve().parent / ".cache"
MODEL = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=384,
             num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5)
TOP_LAYER_SHARE, MASS = 0.3, 0.7
"""The paper's statistic: fewer than 30% of the layers carry more than 70% of the change."""


def build_model(seed: int, config=None) -> torch.nn.Module:
    """The benchmark's 12-layer Llama, or a model of ``config`` (a real model's), seeded."""
    torch.manual_seed(seed)
    cfg = config if config is not None else FAMILIES["llama"].config_class(**MODEL)
    return FAMILIES["llama"].model_class(cfg)


def real_base(model_dir: Path) -> tuple[dict, object, object]:
    """A real pretrained model's fp32 state dict, config and tokenizer (``real_model.py``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.state_dict(), AutoConfig.from_pretrained(str(model_dir)), \
        AutoTokenizer.from_pretrained(str(model_dir))


def lr_lambda(warmup: int, total: int):
    """Linear warmup, cosine decay to 10% of the peak."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
    return f


def next_token_loss(model, batch) -> torch.Tensor:
    """Cross-entropy against ``batch.labels``, which ``train.data`` already shifted to the next
    token (HF's own ``labels=`` would shift them once more: a two-ahead objective)."""
    logits = model(input_ids=batch.input_ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten())


def train_step(model, opt, sched, batch) -> float:
    loss = next_token_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def eval_loss(model, eval_set) -> float:
    model.eval()
    losses = [float(next_token_loss(model, b)) for b in eval_set]
    model.train()
    return sum(losses) / len(losses)


def eval_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, n: int) -> list:
    it = batches(tokens, seq_len, batch_size, seed=99)
    return [next(it) for _ in range(n)]


# ----- the fine-tuning corpus -----------------------------------------------------------------


def _records_of(path: Path, root: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return []
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        para = doc.strip().split("\n\n")[0].strip()
        sig = f"({ast.unparse(node.args)})" if not isinstance(node, ast.ClassDef) else ""
        out.append(f"### Instruction:\nExplain `{module}.{node.name}{sig}`.\n"
                   f"### Response:\n{para}\n")
    return out


def instruction_corpus(n_tokens: int, n_eval_tokens: int, holdout_every: int = 20,
                       tok=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and held-out token streams (at least ``n_tokens`` and ``n_eval_tokens``) of
    instruction records from the standard library read from its end; and how many records.
    ``tok``: anything with ``encode(text) -> ids`` (default: bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    tok = tok or ByteTokenizer()
    train: list[int] = []
    held: list[int] = []
    n = 0
    for path in reversed(files):
        for rec in _records_of(path, root):
            (held if n % holdout_every == holdout_every - 1 else train).extend(tok.encode(rec))
            n += 1
        if len(train) >= n_tokens and len(held) >= n_eval_tokens:
            break
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long), n


# ----- the skew statistic ---------------------------------------------------------------------


class LayerDeltas:
    """Per decoder layer, the L2 norm of its weight change over each step and over each
    checkpoint interval, from the live weights (not the checkpoint tracker's statistics)."""

    def __init__(self, model: torch.nn.Module):
        layers: dict[int, list[torch.Tensor]] = {}
        for name, p in model.named_parameters():
            i = layer_index(group_of(name))
            if i is not None:
                layers.setdefault(i, []).append(p)
        self._layers = [layers[i] for i in sorted(layers)]
        assert len(self._layers) == model.config.num_hidden_layers, sorted(layers)
        self._prev_step = self._flat()
        self._prev_interval = [t.clone() for t in self._prev_step]
        self.per_step: list[list[float]] = []
        self.per_interval: list[list[float]] = []

    @torch.no_grad()
    def _flat(self) -> list[torch.Tensor]:
        return [torch.cat([p.detach().reshape(-1) for p in ps]) for ps in self._layers]

    @torch.no_grad()
    def step(self) -> None:
        cur = self._flat()
        self.per_step.append([float((c - p).norm()) for c, p in zip(cur, self._prev_step)])
        self._prev_step = cur

    @torch.no_grad()
    def interval(self) -> None:
        cur = self._prev_step  # call after ``step``: the weights now
        self.per_interval.append([float((c - p).norm()) for c, p in zip(cur, self._prev_interval)])
        self._prev_interval = [t.clone() for t in cur]


def top_share(changes: list[float], power: float = 1.0) -> float:
    """Share of the total change carried by the most-changed layers that are fewer than
    ``TOP_LAYER_SHARE`` of all (3 of 12): above ``MASS`` is the paper's skew."""
    k = math.ceil(TOP_LAYER_SHARE * len(changes)) - 1
    w = sorted((c ** power for c in changes), reverse=True)
    total = sum(w)
    return sum(w[:k]) / total if total > 0 else 0.0


def skew_stats(rows: list[list[float]]) -> dict:
    """The paper's statistic over ``rows`` (steps or intervals) of per-layer changes: the share
    of rows in which fewer than 30% of the layers carry more than 70% of the change (L2 norms of
    each layer's delta, summed; ``_sq``: squared norms, which add up to the model's squared
    delta), the median share those top layers carry (25% is 3 of 12 equal layers), and how
    unequal the layers are over the whole run (max / min of each layer's summed change)."""
    if not rows:
        return {}
    shares = [top_share(r) for r in rows]
    shares_sq = [top_share(r, 2.0) for r in rows]
    per_layer = [sum(col) for col in zip(*rows)]
    return {
        "rows": len(rows),
        "skew_share": sum(s > MASS for s in shares) / len(rows),
        "skew_share_sq": sum(s > MASS for s in shares_sq) / len(rows),
        "top_layers_share_median": statistics.median(shares),
        "top_layers_share_sq_median": statistics.median(shares_sq),
        "layer_total_max_over_min": max(per_layer) / max(min(per_layer), 1e-30),
        "layer_totals_normalized": [round(x / max(per_layer), 3) for x in per_layer],
    }


# ----- the pre-trained base (cached) ------------------------------------------------------------


def pretrain_key(spec: dict) -> str:
    ident = {**spec, "model": MODEL, "objective": "next-token", "python": platform.python_version(),
             "torch": torch.__version__}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def pretrained_base(spec: dict, cache_dir: Path = CACHE_DIR) -> tuple[dict, dict]:
    """The base's state dict and what its pre-training measured, trained now if not cached.
    ``spec``: steps, lr, warmup, batch_size, seq_len, weight_decay (keys of the cache)."""
    key = pretrain_key(spec)
    path, meta_path = cache_dir / f"base-{key}.pt", cache_dir / f"base-{key}.json"
    if path.exists() and meta_path.exists():
        return torch.load(path, weights_only=True), {**json.loads(meta_path.read_text()), "cached": True}
    t0 = time.perf_counter()
    steps, bs, seq = spec["steps"], spec["batch_size"], spec["seq_len"]
    n_eval = 8 * bs * seq + 1
    tokens = corpus_tokens(steps * bs * seq + 1 + n_eval)
    train_tok, eval_tok = tokens[:-n_eval], tokens[-n_eval:]
    model = build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95),
                            weight_decay=spec["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec["warmup"], steps))
    deltas = LayerDeltas(model)
    data = batches(train_tok, seq, bs, seed=0)
    losses = []
    for step in range(1, steps + 1):
        losses.append(train_step(model, opt, sched, next(data)))
        deltas.step()
        if step % 10 == 0:
            deltas.interval()
    meta = {"key": key, "spec": spec, "train_tokens": int(train_tok.numel()),
            "loss_first_10": statistics.fmean(losses[:10]), "loss_last_10": statistics.fmean(losses[-10:]),
            "eval_loss": eval_loss(model, eval_batches(eval_tok, seq, bs, 8)),
            "skew_per_step": skew_stats(deltas.per_step),
            "skew_per_10_steps": skew_stats(deltas.per_interval),
            "pretrain_s": time.perf_counter() - t0}
    state = model.state_dict()
    atomic_write(path, lambda f: torch.save(state, f))
    atomic_write_text(meta_path, json.dumps(meta, indent=1))
    return state, {**meta, "cached": False}
