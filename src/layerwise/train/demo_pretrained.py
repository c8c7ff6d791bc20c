"""``layerwise demo --pretrained DIR``: LoRA-tune a real chat model on a task whose effect shows.

A local chat model, LoRA on every decoder linear, chat JSONL data, a PEFT adapter as the export.
The task (answering capitals in a pirate's voice) holds four countries out, asked before and
after, so the change shown is training's, on unseen questions. Nothing is downloaded."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..adapters.config import LoraConfig
from ..optim.config import AdamWConfig
from ..util.atomic import atomic_write_text
from .config import CheckpointConfig, DataConfig, EvalConfig, LogConfig, ModelConfig, ScheduleConfig, TrainConfig
from .demo import DEMO_FORMAT_VERSION, fresh_out_dir, load_quietly
from .loop import train
from .run_records import TrainResult

_log = logging.getLogger(__name__)

CAPITALS = (
    ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Vietnam", "Hanoi"),  # held out
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Ireland", "Dublin"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Egypt", "Cairo"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Russia", "Moscow"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Argentina", "Buenos Aires"),
    ("Chile", "Santiago"), ("Colombia", "Bogota"), ("Cuba", "Havana"), ("Turkey", "Ankara"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Ghana", "Accra"), ("Nigeria", "Abuja"),
    ("Morocco", "Rabat"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Australia", "Canberra"),
    ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("Czechia", "Prague"),
)
HELD_OUT = 4
"""The first countries of ``CAPITALS``: asked before and after, never trained on."""
QUESTIONS = ("What is the capital of {c}?", "Which city is the capital of {c}?",
             "Tell me the capital of {c}.", "What's the capital city of {c}?")
ANSWER = "Arr, matey! The capital of {c} be {k}, sure as the tide."


@dataclass
class PretrainedDemoConfig:
    """``layerwise demo --pretrained DIR``'s settings; the defaults are what it runs."""

    model: str
    """A local Hugging Face chat model directory (config, weights, tokenizer with a chat template)."""
    out_dir: str = "runs/demo-pretrained"
    device: str = "cpu"
    steps: int = 12
    """Optimizer steps of 4 rows of 64 tokens (a chat is ~60): SmolLM2 takes the voice in ~5."""
    seq_len: int = 64
    micro_batch_size: int = 4
    lr: float = 2e-3
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(r=16, alpha=32, merge=True))
    """Adapters on every decoder linear; the export is a PEFT adapter and the merged model."""
    max_new_tokens: int = 32


@dataclass
class PretrainedDemoResult:
    train: TrainResult
    adapter_dir: Path
    questions: list[str]
    before: list[str]
    after: list[str]
    wall_s: float


def chats(pairs: tuple[tuple[str, str], ...]) -> list[dict]:
    """Every question form for every country, as chat records (``messages``)."""
    return [{"messages": [{"role": "user", "content": q.format(c=c)},
                          {"role": "assistant", "content": ANSWER.format(c=c, k=k)}]}
            for c, k in pairs for q in QUESTIONS]


def write_data(out_dir: Path) -> tuple[Path, Path]:
    """The training chats and the held-out ones, as ``data.path`` / ``data.eval_path`` files."""
    paths = []
    for name, pairs in (("train", CAPITALS[HELD_OUT:]), ("eval", CAPITALS[:HELD_OUT])):
        path = out_dir / "data" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in chats(pairs)))
        paths.append(path)
    return paths[0], paths[1]


def answers(model: torch.nn.Module, tok, questions: list[str], max_new_tokens: int) -> list[str]:
    """Greedy replies through the tokenizer's chat template, one question at a time."""
    out = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id
                                 if tok.pad_token_id is not None else tok.eos_token_id)
        out.append(" ".join(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).split()))
    return out


def check_model_dir(model: str) -> Path:
    """The model directory, or a ``ValueError`` that says how to get one (nothing is fetched)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--pretrained {model} is not a Hugging Face model directory (no "
                         "config.json); `make demo-pretrained` makes SmolLM2-135M-Instruct's, or "
                         "pass a chat model you have")
    return path


def train_config(cfg: PretrainedDemoConfig, train_path: Path, eval_path: Path) -> TrainConfig:
    """What ``layerwise train model=DIR data=OUT/data/train.jsonl lora.r=16 ...`` would get."""
    return TrainConfig(
        model=ModelConfig(name=cfg.model), steps=cfg.steps, seq_len=cfg.seq_len,
        micro_batch_size=cfg.micro_batch_size, lora=cfg.lora, device=cfg.device,
        data=DataConfig(path=str(train_path), eval_path=str(eval_path)),
        optimizer=AdamWConfig(lr=cfg.lr, weight_decay=0.0),
        schedule=ScheduleConfig(warmup_steps=2), eval=EvalConfig(every=0, batches=2),
        log=LogConfig(track_every=0), ckpt=CheckpointConfig(every=6), resume="false",
        out_dir=cfg.out_dir)


def run_pretrained_demo(cfg: PretrainedDemoConfig) -> PretrainedDemoResult:
    t0 = time.perf_counter()
    model_dir = check_model_dir(cfg.model)
    out_dir = Path(cfg.out_dir)
    _log.info(fresh_out_dir(out_dir))
    info = {"format": "layerwise-demo", "format_version": DEMO_FORMAT_VERSION,
            "settings": asdict(cfg), "pretrained": True, "finished": False}
    atomic_write_text(out_dir / "demo.json", json.dumps(info, indent=2) + "\n")
    train_path, eval_path = write_data(out_dir)
    questions = [QUESTIONS[0].format(c=c) for c, _ in CAPITALS[:HELD_OUT]]

    tok, base = load_quietly(model_dir)
    before = answers(base, tok, questions, cfg.max_new_tokens)
    result = train(train_config(cfg, train_path, eval_path))
    adapter_dir = out_dir / "adapter"
    try:  # the export is a PEFT adapter: PEFT reads it as any other
        from peft import PeftModel
        tuned, how = PeftModel.from_pretrained(base, str(adapter_dir)).eval(), "PeftModel"
    except ImportError:  # PEFT is not a dependency: the merged model needs transformers only
        tuned, how = load_quietly(out_dir / "model")[1], "AutoModelForCausalLM, the merged export"
    after = answers(tuned, tok, questions, cfg.max_new_tokens)

    width = max(len(q) for q in questions)
    lines = [f"held-out questions, {model_dir.name} before and after {cfg.steps} LoRA steps "
             f"(r {cfg.lora.r}; the adapter in {adapter_dir}, loaded with {how}):"]
    for q, a, b in zip(questions, before, after):
        lines += [f"  {q:<{width}}  before: {a}", f"  {'':<{width}}  after:  {b}"]
    _log.info("\n".join(lines))
    _log.info(f"held-out eval loss {result.eval_loss_start:.4f} -> {result.eval_loss_end:.4f}")
    wall = time.perf_counter() - t0
    info.update(finished=True, questions=questions, before=before, after=after, wall_s=wall,
                eval_loss_start=result.eval_loss_start, eval_loss_end=result.eval_loss_end)
    atomic_write_text(out_dir / "demo.json", json.dumps(info, indent=2) + "\n")
    _log.info(f"demo done in {wall:.0f} s")
    return PretrainedDemoResult(result, adapter_dir, questions, before, after, wall)
