"""``layerwise demo``: a user's run end to end, small enough for 2 idle CPU cores in under 3
minutes.

The same path as ``layerwise train model=DIR model.tokenizer=DIR plan=FILE`` with built-in data and
nothing downloaded: learn a BPE tokenizer from the standard library's source, write a plan file,
train ``llama-demo``, reload the export with ``AutoModelForCausalLM`` and run ``layerwise report``.
Every run starts fresh: an earlier demo's directory is replaced; any other non-empty directory is
refused and left as it is."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from ..models import get_flavor
from ..optim.config import AdamWConfig
from ..plan.plan import Plan
from ..util.atomic import atomic_write_text
from .config import DemoConfig, ModelConfig, TrainConfig
from .data import iter_stdlib_files
from .loop import TrainResult, throughput_text, train
from .report import report
from .tokenizer import train_bpe_tokenizer

_log = logging.getLogger(__name__)

DEMO_FORMAT_VERSION = 2
"""``demo.json``'s format (docs/formats.md); 2: ``settings`` in sections (``data.corpus_tokens``,
``ckpt.every``, ...), as ``TrainConfig``'s."""

DEMO_MODEL = "llama-demo"


@dataclass
class DemoResult:
    train: TrainResult
    tokenizer_dir: Path
    plan_path: Path
    report_path: Path
    report_lines: list[str]
    sample: str
    wall_s: float


def demo_texts(max_chars: int, root: str | Path | None = None) -> Iterator[str]:
    """Whole standard-library source files in the corpus' order, until ``max_chars`` is
    reached (the file that crosses it is the last)."""
    total = 0
    for path in iter_stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_chars:
            return


def fresh_out_dir(out_dir: Path) -> str:
    """Make ``out_dir`` an empty directory for a new demo run and say what was done: a missing
    or empty one is used, one an earlier demo left is removed first; anything else is refused
    (``ValueError``, nothing touched)."""
    if not out_dir.exists():
        out_dir.mkdir(parents=True)
        return f"output directory {out_dir} (new)"
    if not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file; pass a directory")
    if not any(out_dir.iterdir()):
        return f"output directory {out_dir} (empty)"
    if not _left_by_a_demo(out_dir):
        raise ValueError(f"--out {out_dir} is not empty and holds no earlier demo run (no demo.json, "
                         f"no run.json of {DEMO_MODEL}); pass another --out or empty it yourself")
    shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    return f"output directory {out_dir} (the earlier demo run there was removed: every demo starts fresh)"


def _left_by_a_demo(out_dir: Path) -> bool:
    if (out_dir / "demo.json").is_file():
        return True
    try:
        info = json.loads((out_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(info, dict) and info.get("model") == DEMO_MODEL


def demo_plan(cfg: DemoConfig) -> Plan:
    """Every other boundary kept (the rest recomputed); 8-bit moments on the decoder layers,
    fp32 on the embedding and the head."""
    num_layers = get_flavor(cfg.model).build_config().num_hidden_layers
    return Plan.every_k(num_layers, 2, micro_batch_size=cfg.micro_batch_size, num_micro_batches=1,
                        seq_len=cfg.seq_len, moments=["fp32", *["8bit"] * num_layers, "fp32"])


def train_config(cfg: DemoConfig, tokenizer_dir: Path, plan_path: Path) -> TrainConfig:
    """The ``TrainConfig`` the demo runs: what ``layerwise train`` would get from
    ``model=llama-demo model.tokenizer=OUT/tokenizer plan=OUT/demo-plan.json ckpt.policy=filter ...``."""
    return TrainConfig(
        model=ModelConfig(name=cfg.model, tokenizer=str(tokenizer_dir)), plan=str(plan_path),
        steps=cfg.steps, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
        data=replace(cfg.data), optimizer=AdamWConfig(lr=cfg.lr, weight_decay=0.1),
        schedule=replace(cfg.schedule), device=cfg.device, eval=replace(cfg.eval),
        log=replace(cfg.log), ckpt=replace(cfg.ckpt), resume="false", out_dir=cfg.out_dir)


def load_quietly(model_dir: Path) -> tuple[Any, torch.nn.Module]:
    """Tokenizer and model of ``model_dir`` loaded the ordinary way (local files, fp32, eval
    mode), without transformers' "Loading weights" bar in the demo's output."""
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                     dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return tok, model.eval()


def sample(model_dir: Path, cfg: DemoConfig) -> str:
    """The prompt and its continuation, from the exported directory loaded the ordinary way."""
    tok, model = load_quietly(model_dir)
    ids = torch.tensor([tok(cfg.prompt, add_special_tokens=False)["input_ids"]])
    greedy = cfg.temperature <= 0
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=cfg.max_new_tokens, do_sample=not greedy,
                             **({} if greedy else {"temperature": cfg.temperature, "top_k": 40}),
                             repetition_penalty=cfg.repetition_penalty,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def run_demo(cfg: DemoConfig) -> DemoResult:
    t0 = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    _log.info(fresh_out_dir(out_dir))
    info: dict[str, Any] = {"format": "layerwise-demo", "format_version": DEMO_FORMAT_VERSION,
                            "settings": asdict(cfg), "finished": False}
    atomic_write_text(out_dir / "demo.json", json.dumps(info, indent=2) + "\n")

    t = time.perf_counter()
    tokenizer_dir = out_dir / "tokenizer"
    tok = train_bpe_tokenizer(demo_texts(cfg.tokenizer_chars), cfg.vocab_size, tokenizer_dir)
    _log.info(f"tokenizer: byte-level BPE, {len(tok)} ids, learnt from "
              f"{cfg.tokenizer_chars / 1e6:g}M characters of the stdlib source in "
              f"{time.perf_counter() - t:.1f} s -> {tokenizer_dir}")
    plan_path = out_dir / "demo-plan.json"
    demo_plan(cfg).save(plan_path)

    result = train(train_config(cfg, tokenizer_dir, plan_path))
    assert result.model_dir is not None  # export is on
    text = sample(result.model_dir, cfg)
    how = "greedy" if cfg.temperature <= 0 else f"temperature {cfg.temperature}, top-k 40"
    _log.info(f"reloaded {result.model_dir} with AutoModelForCausalLM + AutoTokenizer; it "
              f"continues the prompt ({how}, repetition penalty {cfg.repetition_penalty:g}):"
              f"\n---\n{text}\n---")
    _log.info(f"eval loss {result.eval_loss_start:.4f} -> {result.eval_loss_end:.4f}; "
              f"{throughput_text(result)}")
    path, lines = report(out_dir)
    for line in lines[1:]:  # the first names the run directory, said above
        _log.info(line)
    _log.info(f"report of the run (loss, throughput, per-layer change, checkpoints): {path}")
    wall = time.perf_counter() - t0
    info.update(finished=True, eval_loss_start=result.eval_loss_start,
                eval_loss_end=result.eval_loss_end, sample=text, wall_s=wall)
    atomic_write_text(out_dir / "demo.json", json.dumps(info, indent=2) + "\n")
    _log.info(f"demo done in {wall:.0f} s")
    return DemoResult(result, tokenizer_dir, plan_path, path, lines, text, wall)
