"""What a ``layerwise train`` run is told: ``TrainConfig``, in sections, each field documented
right under it (``layerwise train --help`` / ``--help-all`` print these texts).

Torch-free, so ``--help`` and these checks answer in well under a second (checks needing the
model or machine: ``train/checks.py``). The old flat keys (``TrainConfig.removed_keys``) are
refused in one line naming their new key."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from .. import config as config_lib
from ..adapters.config import LoraConfig
from ..optim.config import AdamWConfig
from ..util.checkpoint_config import POLICY_OPTIONS, CheckpointConfig

REPORT_SINKS = ("tensorboard", "wandb")

FINETUNE_DEFAULTS = {"optimizer.lr": 2e-5, "optimizer.weight_decay": 0.0,
                     "schedule.warmup_ratio": 0.03, "num_train_epochs": 3.0}
"""What a pretrained model (a directory or a Hub id, not a built-in flavor trained from scratch)
is fine-tuned with unless told otherwise: HF Trainer's / TRL's usual full fine-tune (the
from-scratch defaults' LR of 2e-3 erases what the model knew)."""
LORA_FINETUNE_LR = 2e-4
"""The LoRA adapters' learning rate on a pretrained model (PEFT's usual)."""
FINETUNE_DEFERS_TO = {"num_train_epochs": ("steps",),
                      "schedule.warmup_ratio": ("schedule.warmup_steps",)}
"""A fine-tuning default left out when the user set the key it would override."""


def _choices(*values: str) -> dict:
    return {"choices": values}


@dataclass
class ModelConfig:
    shorthand: ClassVar[str] = "name"

    name: str = "llama-demo"
    """A flavor (``layerwise.models.FLAVORS``: llama-demo, llama-30m, ...), a local Hugging Face
    model directory, or a Hub id already in the local Hugging Face cache (nothing is downloaded).
    ``model=X`` is short for ``model.name=X``."""
    tokenizer: str = "auto"
    """``auto`` (the model directory's own tokenizer, else the byte tokenizer), ``byte``, or a
    directory with tokenizer files (loaded with local files only)."""
    compute_dtype: str = field(default="auto", metadata=_choices("auto", "float32", "bfloat16"))
    """Dtype of weights and activations on the device: ``auto`` is bf16 on CUDA, fp32 on CPU."""
    rope_scaling: float | None = None
    """Linear RoPE scaling factor, to train with ``seq_len`` beyond the model's
    ``max_position_embeddings`` (up to factor x that): positions are divided by it, and the
    exported config carries it. None: a longer ``seq_len`` is refused."""


@dataclass
class DataConfig:
    shorthand: ClassVar[str] = "path"

    path: str | None = None
    """A data file or directory (.jsonl, .json, .parquet, .txt/.md/.py); none: the built-in
    corpus. ``data=PATH`` is short for ``data.path=PATH``."""
    format: str = field(default="auto", metadata=_choices(
        "auto", "text", "chat", "prompt_completion", "instruction"))
    """How examples are read: ``auto`` picks by the fields present (messages; prompt +
    completion; instruction + output; text)."""
    eval_path: str | None = None
    """Held-out data file or directory (same format); none: ``eval_fraction`` of the data."""
    eval_fraction: float = 0.05
    """Fraction of the data's examples held out for eval when ``eval_path`` is not given."""
    pack: bool = True
    """Pack short examples into ``seq_len`` rows (each example attends to itself only and its
    loss stays its own: it trains as it would alone in a row); false: one example a row,
    padded."""
    skip_bad: bool = False
    """Skip bad examples (malformed, missing fields, nothing to train on) and report the count,
    instead of stopping with an error naming the file and line."""
    cache: bool = True
    """Keep the tokenized data in ``out_dir/data_cache`` so a resumed run does not redo it."""
    corpus: str | None = None
    """Directory of ``.py`` text files for the built-in corpus; none: the Python standard
    library's source."""
    corpus_tokens: int = 2_000_000
    """Tokens read from the built-in corpus (the last 5% are held out for eval)."""


@dataclass
class ScheduleConfig:
    shorthand: ClassVar[str] = "name"

    name: str = field(default="cosine", metadata=_choices("cosine", "linear", "constant"))
    """Learning-rate decay after warmup: cosine or linear down to ``min_lr_ratio`` of the peak,
    or constant at the peak."""
    warmup_steps: int = 5
    """Linear warmup steps from 0 to the peak LR (``warmup_ratio`` wins when set)."""
    warmup_ratio: float | None = None
    """Warmup as a fraction of the schedule's steps (HF's ``warmup_ratio``), e.g. 0.03."""
    min_lr_ratio: float = 0.1
    """The decay's floor, as a fraction of the peak LR."""
    total_steps: int | None = None
    """Steps the decay spans; none: the run's steps when it started. A resumed run that is
    extended (steps 40 -> 60) keeps its schedule (the LR stays at the floor after step 40)
    unless this is set."""


@dataclass
class EvalConfig:
    every: int = 20
    """Evaluate the held-out loss every N steps (0: only at the start and the end)."""
    batches: int = 4
    """Held-out micro-batches per evaluation."""
    samples: int = 0
    """At each evaluation, greedy continuations of this many held-out rows (their first 16
    tokens as the prompt), logged and kept in ``out_dir/samples.jsonl``. Each new token is a
    forward pass over all layers: keep it small on big models."""
    prompts: list[str] = field(default_factory=list)
    """Text prompts to continue at each evaluation instead of held-out rows."""
    sample_tokens: int = 32
    """Tokens generated per sample."""


@dataclass
class DistConfig:
    timeout_s: float = 600.0
    """Under torchrun: every collective, and every wait for another rank, gives up after this
    many seconds (a dead peer then ends the run with an error instead of a hang)."""
    shm_dir: str = "/dev/shm"
    """Under torchrun: the tmpfs directory holding each node's shared host store while the
    local ranks map it (the files are removed once all have); its free space is checked
    against the store first."""
    grad_reduce: str = field(default="device", metadata=_choices("device", "host"))
    """Under torchrun: where the ranks of a node sum each unit's gradient: ``device`` (every
    micro-batch's, on the device with NCCL before the copy out, which only the unit's owner
    then makes) or ``host`` (each rank lands its own; gloo sums the fp32 host gradients)."""


@dataclass
class LogConfig:
    every: int = 5
    """Print a progress line every N steps (plain-line progress)."""
    progress: str = field(default="auto", metadata=_choices("auto", "bar", "lines"))
    """``auto`` (a progress bar on a terminal, plain lines otherwise), ``bar`` or ``lines``."""
    track_every: int = 10
    """Per-layer update statistics into ``tracker.jsonl`` every N steps and at the end (0: off)."""
    report_to: list[str] = field(default_factory=list, metadata=_choices(*REPORT_SINKS))
    """Also send metrics to: tensorboard (``out_dir/tensorboard``; needs the tensorboard
    package) and/or wandb (needs wandb, logged in); e.g. ``log.report_to=tensorboard``."""


@dataclass(init=False)
class TrainConfig:
    removed_keys: ClassVar[dict[str, str]] = {
        "warmup_steps": "schedule.warmup_steps", "min_lr_ratio": "schedule.min_lr_ratio",
        "compute_dtype": "model.compute_dtype", "tokenizer": "model.tokenizer",
        "corpus": "data.corpus", "corpus_tokens": "data.corpus_tokens",
        "data_format": "data.format", "eval_data": "data.eval_path",
        "eval_fraction": "data.eval_fraction", "pack": "data.pack",
        "data_skip_bad": "data.skip_bad", "data_cache": "data.cache",
        "eval_every": "eval.every", "eval_batches": "eval.batches", "log_every": "log.every",
        "progress": "log.progress", "track_every": "log.track_every",
        "ckpt_every": "ckpt.every", "ckpt_policy": "ckpt.policy", "ckpt_options": "ckpt.*",
        "dist_timeout_s": "dist.timeout_s", "dist_shm_dir": "dist.shm_dir"}
    """The flat config's keys -> today's, for the line that refuses an old one."""
    aliases: ClassVar[dict[str, str]] = {
        "learning_rate": "optimizer.lr", "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay",
        "max_steps": "steps", "gradient_accumulation_steps": "grad_accum",
        "per_device_train_batch_size": "micro_batch_size", "output_dir": "out_dir",
        "warmup_ratio": "schedule.warmup_ratio", "warmup_steps": "schedule.warmup_steps",
        "lr_scheduler_type": "schedule.name", "model_name_or_path": "model",
        "max_seq_length": "seq_len", "max_length": "seq_len", "save_steps": "ckpt.every",
        "save_total_limit": "ckpt.save_total_limit", "eval_steps": "eval.every",
        "logging_steps": "log.every", "resume_from_checkpoint": "resume_from_checkpoint"}
    """HF ``TrainingArguments`` / TRL names -> the keys that mean the same here (accepted)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: AdamWConfig = field(default_factory=lambda: AdamWConfig(lr=2e-3, weight_decay=0.1))
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    out_dir: str = "runs/train"
    """Where the run goes: run.json, metrics.jsonl, plan.json, ckpt/, model/ (one run at a time:
    a second run into it is refused while the first holds its lock)."""
    steps: int = 60
    """Optimizer steps (``num_train_epochs`` wins when set)."""
    num_train_epochs: float | None = None
    """The run's length in passes over the training rows, e.g. 3 (sets ``steps``)."""
    seq_len: int = 128
    """Tokens per sequence (at most the model's ``max_position_embeddings``, see
    ``model.rope_scaling``)."""
    micro_batch_size: int = 8
    """Sequences per micro-batch, per rank (a plan file's value wins)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (a plan file's value wins)."""
    seed: int = 0
    """Seed for initialisation (flavors) and data order."""
    device: str = "auto"
    """``auto`` (CUDA when there is a GPU, else the CPU; the run says which), ``cpu`` or
    ``cuda[:N]``."""
    resume: str = field(default="auto", metadata=_choices("auto", "true", "false"))
    """``auto``: continue the run in ``out_dir`` when it holds one of this model with a
    checkpoint, else start fresh; ``true``: continue it (an error when there is nothing to
    continue); ``false``: start fresh (``out_dir`` must hold no run, or pass ``overwrite``)."""
    resume_from_checkpoint: str | None = None
    """Start from another run's checkpoint: its out_dir or ckpt/ dir (newest step), a step dir
    (``.../ckpt/steps/000000000040``) or ``PATH@STEP``."""
    overwrite: bool = False
    """Start fresh in an ``out_dir`` that holds a run: its checkpoints, metrics and export are
    deleted first (its data cache is kept)."""
    export: bool = True
    """Write the trained model to ``out_dir/model`` as a Hugging Face directory."""
    plan: str = "fit"
    """``fit`` (the rule that recomputes least whose predicted device peak fits: keep-internals
    where memory does not bind, e.g. a CPU; else keep-all, every-2, every-4, recompute-all),
    ``every-K``, ``recompute-all``, ``keep-all`` (every boundary kept, each layer's forward run
    again in its backward), ``keep-internals`` (every layer's forward graph kept: nothing
    recomputed), ``auto`` (the planner chooses boundary tiers,
    the micro-batch split of ``micro_batch_size x grad_accum`` sequences and per-unit moments for
    the hardware below) or a plan JSON file from ``layerwise plan``."""
    profile: str | None = None
    """Hardware profile file (``layerwise calibrate --out``) to plan and predict with; default:
    ``out_dir/profile.json`` when it exists."""
    hardware: str | None = None
    """Hardware preset (h200, h100, a100-80g, rtx4090, cpu, ...) when there is no calibrated
    profile; default: this machine."""
    plan_time_limit_s: float = 5.0
    """``plan=auto``: MILP time limit per micro-batch size tried, seconds."""
    host_mem_gb: float | None = None
    """RAM the host store may take, GB; a larger store puts units' optimizer-side state (master
    remainder and moments) in files under ``state_dir``, the fewest units that fit (default: no
    cap; a plan's own ``state_tiers`` are obeyed either way)."""
    state_dir: str | None = None
    """Where units' state on NVMe lives: a directory on a local NVMe drive (default
    ``out_dir/nvme-state``). Working memory, removed when the run ends; checkpoints hold the state."""
    device_mem_cap_gb: float | None = None
    """Refuse plans predicted to need more device memory than this (default on CUDA: the
    device's memory)."""

    def __init__(self, **kwargs):
        """Fields by name; ``model="DIR"`` and ``data="PATH"`` set the section's main field. A
        flat config's key (``ckpt_every=3``) is a ``TypeError`` naming its new one, as an
        unknown key is."""
        for key, value in config_lib._flatten({k: v for k, v in kwargs.items() if k in self.removed_keys}):
            raise TypeError(config_lib.removed_key(key, value, TrainConfig))
        flat = {k: v for k, v in kwargs.items()
                if k in ("model", "data", "schedule") and not dataclasses.is_dataclass(v)}
        hints = config_lib._types(TrainConfig)
        for f in dataclasses.fields(self):
            given = f.name in kwargs and f.name not in flat
            value = kwargs.pop(f.name) if given else config_lib._default(f)
            if given and not dataclasses.is_dataclass(value):  # resume=False -> "false", ...
                value = config_lib.coerce(value, hints[f.name], f.name)
                config_lib._check_choice(value, f.metadata.get("choices"), f.name)
            setattr(self, f.name, value)
        unknown = set(kwargs) - set(flat)
        if unknown:
            raise TypeError(f"TrainConfig got unknown keys {sorted(unknown)}"
                            + config_lib.suggest(sorted(unknown)[0], config_lib._known_keys(TrainConfig)))
        if flat:
            data = config_lib.normalize(TrainConfig, flat)
            for name, part in data.items():
                section = getattr(self, name)
                merged = config_lib.merge(config_lib.to_dict(section), part)
                setattr(self, name, config_lib.from_dict(type(section), merged, name + "."))

    def check(self) -> None:
        """Refuse, before any work, settings no run can use (one ``ValueError`` naming the key
        and the fix). What needs the model or the machine is checked in ``train/checks.py``."""
        positive = {"steps": self.steps, "seq_len": self.seq_len,
                    "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
                    "eval.batches": self.eval.batches, "log.every": self.log.every,
                    "data.corpus_tokens": self.data.corpus_tokens,
                    "eval.sample_tokens": self.eval.sample_tokens,
                    "dist.timeout_s": self.dist.timeout_s,
                    "plan_time_limit_s": self.plan_time_limit_s}
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        at_least_0 = {"eval.every": self.eval.every, "log.track_every": self.log.track_every,
                      "ckpt.every": self.ckpt.every, "eval.samples": self.eval.samples,
                      "schedule.warmup_steps": self.schedule.warmup_steps}
        for key, value in at_least_0.items():
            if not value >= 0:
                raise ValueError(f"{key} must be >= 0 (0: off), got {value}")
        optional_positive = {"num_train_epochs": self.num_train_epochs,
                             "schedule.total_steps": self.schedule.total_steps,
                             "ckpt.save_total_limit": self.ckpt.save_total_limit,
                             "model.rope_scaling": self.model.rope_scaling,
                             "device_mem_cap_gb": self.device_mem_cap_gb,
                             "host_mem_gb": self.host_mem_gb}
        for key, value in optional_positive.items():
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{key} must be > 0 (or none), got {value}")
        self.optimizer.check()
        self.lora.check()
        self._check_fractions()
        self._check_ckpt()
        if self.overwrite and self.resume == "true":
            raise ValueError("overwrite=true starts afresh and resume=true continues: pick one")

    def _check_fractions(self) -> None:
        s = self.schedule
        if s.warmup_ratio is not None and not 0 <= s.warmup_ratio < 1:
            raise ValueError(f"schedule.warmup_ratio must be in [0, 1), got {s.warmup_ratio}")
        if not 0 <= s.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
        if self.data.path is not None and self.data.eval_path is None and not (
                0 < self.data.eval_fraction < 1):
            raise ValueError(f"data.eval_fraction must be in (0, 1) without data.eval_path, "
                             f"got {self.data.eval_fraction}")

    def _check_ckpt(self) -> None:
        c = self.ckpt
        for key, policies in POLICY_OPTIONS.items():
            if getattr(c, key) is not None and c.policy not in policies:
                raise ValueError(f"ckpt.{key} is an option of the {'/'.join(policies)} policy, "
                                 f"not of ckpt.policy={c.policy}")
        for key in ("threshold", "max_fraction", "budget_fraction"):
            value = getattr(c, key)
            if value is not None and not value >= 0:
                raise ValueError(f"ckpt.{key} must be >= 0, got {value}")
        for key in ("k", "budget_bytes", "full_every"):
            value = getattr(c, key)
            if value is not None and not value >= 1:
                raise ValueError(f"ckpt.{key} must be >= 1, got {value}")
        if c.max_staleness is not None and c.max_staleness < 0:
            raise ValueError(f"ckpt.max_staleness must be >= 0, got {c.max_staleness}")

    @property
    def checkpoints(self) -> bool:
        """Whether the run writes checkpoints at all."""
        return self.ckpt.every > 0 or self.ckpt.at_end


COMMON_KEYS = ["model", "data", "out_dir", "steps", "num_train_epochs", "seq_len",
               "micro_batch_size", "grad_accum", "optimizer.lr", "schedule.name",
               "schedule.warmup_ratio", "plan", "device", "ckpt.every", "ckpt.policy",
               "ckpt.save_total_limit", "resume", "resume_from_checkpoint", "overwrite",
               "eval.every", "eval.samples", "log.report_to"]
"""The keys ``layerwise train --help`` shows (``--help-all``: every key)."""


def help_keys() -> list[str]:
    """``COMMON_KEYS`` as dotted leaf keys (a section's shorthand named by the field)."""
    secs = config_lib.sections(TrainConfig)
    return [f"{k}.{secs[k].shorthand}" if k in secs else k for k in COMMON_KEYS]


@dataclass
class DemoConfig:
    """The demo's settings; the defaults are what ``layerwise demo`` runs."""

    steps: int = 400
    """Optimizer steps (16 x 128 tokens each: about 0.8M tokens, 1.4 passes over the corpus)."""
    out_dir: str = "runs/demo"
    """Where the run goes (replaced when an earlier demo left it; see ``train/demo.py``)."""
    device: str = "auto"
    """``auto`` (CUDA when there is a GPU, else the CPU; the run says which), ``cpu`` or
    ``cuda[:N]``."""
    model: str = "llama-demo"
    """A flavor whose vocabulary holds the tokenizer's (``llama-demo``: 1024 rows, 0.9M params)."""
    vocab_size: int = 1024
    """The BPE tokenizer's vocabulary (special token + 256 bytes + merges): small, so that
    every id is seen often in a short run, yet ``self``, ``return``, indentation are one id."""
    tokenizer_chars: int = 2_000_000
    """Characters of standard-library source (whole files, in sorted order) the tokenizer learns
    from: about 2 MB, a second or two."""
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch_size: int = 16
    """Sequences per step (one micro-batch)."""
    lr: float = 1e-2
    """Peak learning rate (linear warmup, cosine decay to a tenth)."""
    data: DataConfig = field(default_factory=lambda: DataConfig(corpus_tokens=600_000))
    """``data.corpus_tokens``: tokens read from the same files (about 1.8M characters; the last
    5% held out for eval)."""
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=10))
    """``schedule.warmup_steps``: linear warmup to ``lr``, then the run's decay."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every=50))
    """Held-out eval every ``eval.every`` steps (and at the start and end)."""
    log: LogConfig = field(default_factory=lambda: LogConfig(track_every=10))
    """``log.track_every``: per-layer update statistics (``tracker.jsonl``, the report's heat
    map); ``log.progress``: a bar on a terminal, plain lines otherwise."""
    ckpt: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(
        every=50, policy="filter", threshold=0.1, max_staleness=2))
    """A layer-wise checkpoint every 50 steps and at the end, ``filter`` policy: a group is
    written when its weights moved more than ``threshold`` (relative) since its saved version,
    or when its newest version is more than ``max_staleness`` saves old."""
    prompt: str = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"
    """What the trained model continues."""
    max_new_tokens: int = 100
    """Tokens generated after the prompt."""
    temperature: float = 0.0
    """0: greedy decoding; above 0: sampling at this temperature (top-k 40, seed 0)."""
    repetition_penalty: float = 1.3
    """``generate``'s ``repetition_penalty``: makes ids already in the text less likely, which
    keeps a small model's greedy output from looping on one line."""
