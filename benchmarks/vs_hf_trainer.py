"""``layerwise train`` beside the Hugging Face ``Trainer`` on the same job: tokens/s, peak RSS and
held-out loss, LoRA and full fine-tuning of SmolLM2-135M-Instruct on the CPU.

The job (both sides): a chat JSONL made here, "What is a+b?" -> "a+b = c" for random a, b (300
examples, the last 30 held out, ``data.eval_path``), rendered with the model's chat template,
loss on the assistant tokens only (``train.formats``: the assistant turn and the template's
end-of-turn), packed into rows of ``--seq-len`` (layerwise's default ``data.pack=true``: each
example attends to itself only, positions restart at each). The HF side trains on the very rows
and micro-batches ``layerwise train`` draws (``train.data.prepare_data`` and its batch stream, in
the HF child): ``position_ids`` restart per example and no attention mask, so transformers builds
the same block-diagonal mask (``masking_utils.find_packed_sequence_indices``); the labels are
already shifted and passed as ``shift_labels`` (the loss does not shift them again).

Same shapes (``--seq-len``, ``--micro-batch``, ``--grad-accum``), steps, fp32, and optimizer:
AdamW at layerwise's fine-tuning LR (2e-5 full, 2e-4 LoRA), betas and eps of
``optim.config.AdamWConfig``, weight decay 0, gradient clip 1.0, warmup ``ceil(0.03 x steps)``
steps then cosine to 10% of the peak (layerwise's ``train.schedule``; on the HF side the same
function as a ``LambdaLR``, HF's own AdamW). LoRA: r 16, alpha 32, dropout 0, every linear of the
decoder layers (layerwise ``lora.target_modules=all-linear``, PEFT ``target_modules="all-linear"``).
Everything else is each side's default; layerwise gets ``eval.every=0`` and ``ckpt.every=0
ckpt.at_end=false`` so that no evaluation or checkpoint falls inside the timed steps (it still
exports the model after the last step, as HF saves its own, for the held-out loss).

Timing: only the optimizer steps after start-up (model load and tokenization excluded). layerwise:
``step_s`` and ``tokens`` of each ``out_dir/metrics.jsonl`` row (the engine's step time); HF: a
``TrainerCallback`` timing ``on_step_begin`` -> ``on_step_end`` (its batches are fetched before
``on_step_begin``). Tokens are whole rows (``rows x seq_len``, padding included) on both sides.
A run's tokens/s: its tokens over its step time, the first step left out (warm-up); each side's
figure is the median over ``--repeats`` runs, the two sides alternating run by run (which goes
first alternates too), so both see the same machine. Both processes run with the same torch
thread count (``--threads``: ``OMP_NUM_THREADS`` and ``torch.set_num_threads``; layerwise leaves
torch's count alone on the CPU).

Peak RSS: each child's ``ru_maxrss`` from ``os.wait4`` (the kernel's, per process; model load and
the save after training included on both sides).

Held-out loss: each final model (layerwise ``out_dir/model`` or ``out_dir/adapter``; HF's
``save_model``) loaded with transformers (+ PEFT for the adapters) in this process, the mean
cross-entropy over the assistant tokens of the 30 held-out examples, one example at a time,
token-weighted; the base model's is printed beside them.

Save size (``--saves``): the full fine-tune with a checkpoint every ``steps`` steps on both sides,
run to ``2 x steps``: bytes on disk of the second save. layerwise's default (``ckpt.policy=full``,
lossless: a resume is bit-identical) and ``ckpt.encoding=delta`` (lossless too) are measured
by running to ``steps`` then the same command to ``2 x steps`` (the resume path users run), the
run directory's ``du`` before and after; HF's is its ``checkpoint-N`` directory (model,
optimizer, scheduler, RNG). Ratios: layerwise's second save over HF's checkpoint.

Prints one JSON object. ``--quick``: 6 steps, one repeat (checks that it runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # the sibling real_model

LAYERWISE_MAIN = "import sys; from layerwise.cli import main; sys.exit(main(sys.argv[1:]))"
LR = {"full": 2e-5, "lora": 2e-4}  # layerwise's fine-tuning defaults (train.config)
LORA = {"r": 16, "alpha": 32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="6 steps, one repeat")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 12; quick 6)")
    p.add_argument("--repeats", type=int, default=None, help="runs per side and case (default 3; quick 1)")
    p.add_argument("--cases", default="lora,full", help="lora, full or both")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads of both processes")
    p.add_argument("--examples", type=int, default=300)
    p.add_argument("--held-out", type=int, default=30)
    p.add_argument("--dir", default=None, help="where the runs go (default: a temp dir, removed)")
    p.add_argument("--saves", action="store_true", help="measure the save size instead (full case)")
    p.add_argument("--hf-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps is None:
        a.steps = 6 if a.quick else 12
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    if not set(a.cases) <= {"lora", "full"}:
        p.error("--cases: lora, full")
    return a


# ----- the job ---------------------------------------------------------------------------------


def write_data(d: Path, n: int, held: int, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        rows.append(json.dumps({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                             {"role": "assistant", "content": f"{a}+{b} = {a + b}"}]}))
    train, ev = d / "train.jsonl", d / "eval.jsonl"
    train.write_text("\n".join(rows[:n - held]) + "\n")
    ev.write_text("\n".join(rows[n - held:]) + "\n")
    return train, ev


def warmup_steps(steps: int) -> int:
    return math.ceil(0.03 * steps)  # layerwise's fine-tuning schedule.warmup_ratio


def job(args, case: str, model: Path, train: Path, ev: Path) -> dict:
    from layerwise.optim.config import AdamWConfig
    opt = AdamWConfig()
    return {"case": case, "model": str(model), "train": str(train), "eval": str(ev),
            "steps": args.steps, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum, "lr": LR[case], "betas": list(opt.betas), "eps": opt.eps,
            "weight_decay": 0.0, "max_grad_norm": 1.0, "warmup_steps": warmup_steps(args.steps),
            "min_lr_ratio": 0.1, "schedule": "cosine", "threads": args.threads, "seed": 0}


def child_env(threads: int) -> dict:
    src = str(HERE.parent.parent / "src")
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TOKENIZERS_PARALLELISM": "false"}


def run_child(cmd: list[str], env: dict, log: Path) -> dict:
    """Run ``cmd``; its exit status, wall time and peak RSS (the kernel's, this child alone)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{cmd[:4]}... exited {p.returncode}; last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-20:]))
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mib": usage.ru_maxrss / 1024}


def run_layerwise(j: dict, out: Path, ckpt: list[str] | None = None) -> dict:
    """``ckpt``: the checkpoint settings (default: none saved inside the timed steps)."""
    cmd = [sys.executable, "-c", LAYERWISE_MAIN, "train", f"model={j['model']}", f"data={j['train']}",
           f"data.eval_path={j['eval']}", f"out_dir={out}", f"steps={j['steps']}",
           f"seq_len={j['seq_len']}", f"micro_batch_size={j['micro_batch']}",
           f"grad_accum={j['grad_accum']}", f"optimizer.lr={j['lr']}",
           f"optimizer.weight_decay={j['weight_decay']}", f"optimizer.max_grad_norm={j['max_grad_norm']}",
           f"schedule.name={j['schedule']}", f"schedule.warmup_steps={j['warmup_steps']}",
           f"schedule.min_lr_ratio={j['min_lr_ratio']}", f"seed={j['seed']}",
           "eval.every=0", "log.progress=lines", "device=cpu",
           *(["ckpt.every=0", "ckpt.at_end=false"] if ckpt is None else ckpt)]
    if j["case"] == "lora":
        cmd += [f"lora.r={LORA['r']}", f"lora.alpha={LORA['alpha']}"]  # target_modules: all-linear, the default
    res = run_child(cmd, child_env(j["threads"]), out.with_suffix(".log"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r]
    res["steps"] = [{"step_s": r["step_s"], "tokens": r["tokens"], "loss": r["loss"]} for r in rows]
    res["final"] = str(out / ("adapter" if j["case"] == "lora" else "model"))
    return res


def run_hf(j: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE), "--hf-child", json.dumps({**j, "out": str(out)})]
    res = run_child(cmd, child_env(j["threads"]), out.with_suffix(".log"))
    res.update(json.loads((out / "steps.json").read_text()))
    res["final"] = str(out / "model")
    return res


def tokens_per_s(steps: list[dict]) -> float:
    timed = steps[1:] if len(steps) > 1 else steps  # the first step warms up
    return sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed)


# ----- the HF side (a child process) -------------------------------------------------------------


def hf_child(j: dict) -> None:
    import torch
    torch.set_num_threads(j["threads"])
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from layerwise.train.data import DataSpec, prepare_data
    from layerwise.train.schedule import Schedule
    from layerwise.train.tokenizer import load_hf_tokenizer

    out = Path(j["out"])
    tok = load_hf_tokenizer(j["model"])
    data = prepare_data(DataSpec(data=j["train"], eval_data=j["eval"], seq_len=j["seq_len"],
                                 pack=True, seed=j["seed"], cache=False), tok, out)
    stream = data.batches(j["micro_batch"], seed=j["seed"])  # what `layerwise train` draws
    rows = []
    for _ in range(j["steps"] * j["grad_accum"]):
        b = next(stream)
        for i in range(b.input_ids.shape[0]):
            rows.append(hf_row(b.input_ids[i], b.labels[i], b.segment_ids[i]))

    model = AutoModelForCausalLM.from_pretrained(j["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    if j["case"] == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                                                 lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    sched = Schedule.resolve(j["schedule"], j["lr"], j["steps"], j["warmup_steps"], None,
                             j["min_lr_ratio"])

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    class SameOrderTrainer(Trainer):
        def _get_train_sampler(self, *a, **kw):  # layerwise's micro-batch order, as drawn above
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda s: sched.lr(s) / sched.peak_lr)
            return self.lr_scheduler

    targs = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=j["steps"], per_device_train_batch_size=j["micro_batch"],
        gradient_accumulation_steps=j["grad_accum"], learning_rate=j["lr"],
        weight_decay=j["weight_decay"], adam_beta1=j["betas"][0], adam_beta2=j["betas"][1],
        adam_epsilon=j["eps"], max_grad_norm=j["max_grad_norm"], warmup_steps=j["warmup_steps"],
        logging_steps=1, save_strategy="steps" if j.get("save_steps") else "no",
        save_steps=j.get("save_steps") or 500, eval_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=j["seed"], data_seed=j["seed"], disable_tqdm=True,
        remove_unused_columns=False)
    timer = Timer()
    trainer = SameOrderTrainer(model=model, args=targs, train_dataset=rows, data_collator=collate,
                               callbacks=[timer])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = j["micro_batch"] * j["grad_accum"] * j["seq_len"]
    trainer.save_model(str(out / "model"))
    (out / "steps.json").write_text(json.dumps({"steps": [
        {"step_s": t, "tokens": tokens, "loss": loss} for t, loss in
        zip(timer.times, losses + [None] * (len(timer.times) - len(losses)))]}))


def hf_row(input_ids, labels, segment_ids) -> dict:
    """A packed row for HF: positions restart at each example (padding: its own run), labels
    already shifted (``shift_labels``; ``labels`` only for the Trainer's token count)."""
    import torch
    seg = segment_ids.tolist()
    pos, prev, k = [], None, 0
    for s in seg:
        k = 0 if s != prev else k + 1
        pos.append(k)
        prev = s
    return {"input_ids": input_ids.clone(), "labels": labels.clone(), "shift_labels": labels.clone(),
            "position_ids": torch.tensor(pos, dtype=torch.long)}


def collate(rows: list[dict]) -> dict:
    import torch
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# ----- held-out loss ------------------------------------------------------------------------------


def held_out_loss(model_dir: str, base: Path, ev: Path, case: str | None) -> float:
    """Mean cross-entropy over the assistant tokens of the held-out examples (one at a time)."""
    import torch
    from transformers import AutoModelForCausalLM

    from layerwise.train.formats import encode_example
    from layerwise.train.tokenizer import load_hf_tokenizer

    if case == "lora":
        from peft import PeftModel
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    tok = load_hf_tokenizer(base)
    total, n = 0.0, 0
    with torch.no_grad():
        for line in ev.read_text().splitlines():
            t = encode_example(json.loads(line), "chat", tok)
            ids = torch.tensor([t.ids])
            labels = torch.tensor([[i if m else -100 for i, m in zip(t.ids, t.mask)]])
            logits = model(input_ids=ids).logits[0, :-1].float()
            tgt = labels[0, 1:]
            total += float(torch.nn.functional.cross_entropy(logits, tgt, ignore_index=-100,
                                                             reduction="sum"))
            n += int((tgt != -100).sum())
    return total / n


# ----- the machine ----------------------------------------------------------------------------


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = round(kb / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem, "python": platform.python_version()}


def versions() -> dict:
    import peft
    import torch
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def du_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_saves(args, model: Path, train: Path, ev: Path, root: Path) -> dict:
    """Bytes of the second save: layerwise (default and ``ckpt.encoding=delta``) and HF."""
    j = job(args, "full", model, train, ev)
    out: dict = {"every_steps": args.steps}
    for enc in ("plain", "delta"):
        run = root / f"saves-{enc}"
        ckpt = [f"ckpt.every={args.steps}", f"ckpt.encoding={enc}"]
        run_layerwise(j, run, ckpt)
        first = du_bytes(run / "ckpt")
        run_layerwise({**j, "steps": 2 * args.steps}, run, ckpt)
        out[enc] = {"first_save_bytes": first, "second_save_bytes": du_bytes(run / "ckpt") - first}
    hf = root / "saves-hf"
    run_hf({**j, "steps": 2 * args.steps, "save_steps": args.steps}, hf)
    out["hf_checkpoint_bytes"] = du_bytes(hf / "trainer" / f"checkpoint-{2 * args.steps}")
    for enc in ("plain", "delta"):
        out[enc]["ratio_to_hf"] = round(out[enc]["second_save_bytes"] / out["hf_checkpoint_bytes"], 3)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hf_child is not None:
        hf_child(json.loads(args.hf_child))
        return
    import torch
    torch.set_num_threads(args.threads)  # the held-out evaluations here
    from real_model import smollm2_dir
    model = smollm2_dir()
    load_before = os.getloadavg()
    print(f"machine: {machine()}; load average {load_before}", file=sys.stderr)
    tmp = tempfile.TemporaryDirectory() if args.dir is None else None
    root = Path(args.dir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    train, ev = write_data(root, args.examples, args.held_out)
    if args.saves:
        print(json.dumps({"saves": measure_saves(args, model, train, ev, root), "machine": {
            **machine(), "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in os.getloadavg()]}}, indent=1))
        if tmp is not None:
            tmp.cleanup()
        return
    runs: dict[str, dict[str, list]] = {c: {"layerwise": [], "hf": []} for c in args.cases}
    for rep in range(args.repeats):
        for ci, case in enumerate(args.cases):
            j = job(args, case, model, train, ev)
            order = ["layerwise", "hf"] if (rep + ci) % 2 == 0 else ["hf", "layerwise"]
            for side in order:
                out = root / f"{case}-{side}-{rep}"
                res = (run_layerwise if side == "layerwise" else run_hf)(j, out)
                res["tokens_per_s"] = tokens_per_s(res["steps"])
                runs[case][side].append(res)
                print(f"{case} {side} run {rep + 1}: {res['tokens_per_s']:.1f} tokens/s, peak RSS "
                      f"{res['peak_rss_mib']:.0f} MiB, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    load_after = os.getloadavg()
    out: dict = {"inputs": {**{k: v for k, v in job(args, args.cases[0], model, train, ev).items()
                               if k not in ("case", "lr", "train", "eval")},
                            "lr": {c: LR[c] for c in args.cases}, "lora": LORA | {"dropout": 0.0,
                            "target_modules": "all-linear"}, "examples": args.examples,
                            "held_out": args.held_out, "repeats": args.repeats, "pack": True,
                            "quick": args.quick, "versions": versions()},
                 "machine": {**machine(), "load_avg_before": [round(x, 2) for x in load_before],
                             "load_avg_after": [round(x, 2) for x in load_after]}}
    base_loss = held_out_loss(str(model), model, ev, None)
    for case in args.cases:
        lw, hf = runs[case]["layerwise"], runs[case]["hf"]
        lw_tps = statistics.median(r["tokens_per_s"] for r in lw)
        hf_tps = statistics.median(r["tokens_per_s"] for r in hf)
        lw_rss = statistics.median(r["peak_rss_mib"] for r in lw)
        hf_rss = statistics.median(r["peak_rss_mib"] for r in hf)
        lw_loss = held_out_loss(lw[-1]["final"], model, ev, case)
        hf_loss = held_out_loss(hf[-1]["final"], model, ev, case)
        out[case] = {
            "tokens_per_s_ratio": round(lw_tps / hf_tps, 3),
            "layerwise_tokens_per_s": round(lw_tps, 2), "hf_tokens_per_s": round(hf_tps, 2),
            "layerwise_tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in lw],
            "hf_tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in hf],
            "layerwise_peak_rss_mib": round(lw_rss), "hf_peak_rss_mib": round(hf_rss),
            "peak_rss_ratio": round(lw_rss / hf_rss, 3),
            "held_out_loss": {"base": round(base_loss, 4), "layerwise": round(lw_loss, 4),
                              "hf": round(hf_loss, 4)},
            "train_loss_last": {"layerwise": lw[-1]["steps"][-1]["loss"],
                                "hf": hf[-1]["steps"][-1]["loss"]},
        }
    print(json.dumps(out, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
