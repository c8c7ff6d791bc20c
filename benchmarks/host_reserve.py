"""What a training run holds in host RAM beside its store: the figure the presets' host reserve
is made of (``planner/presets.py``, [HOSTRES]).

Each round is a fresh process running a ``layerwise train`` run (``train.loop.Trainer``: data
loading, the engine with its landing threads and pinned gradient ring, the optimizer, the
tracker) of a >= 100M-parameter llama-style model built from a config, with bf16 compute and
8-bit moments on the ``cpu-async`` backend (lanes as threads, as on a GPU), one micro-batch per
step (bf16 host gradients). The process's RSS (``/proc/self/status`` VmRSS; VmHWM for peaks,
reset with ``/proc/self/clear_refs``) is read at the start (imports done), after setup, and as a
peak over the steps. From it are taken, each from the live tensors' storages (never a formula):

- the store (``store_alloc_bytes``: every distinct storage of the store's buffers, its arena,
  its optimizer state);
- what a GPU holds on the device and the CPU backend holds in host RAM: the engine's device
  slots (``backend.allocated_bytes``) and the step's device peak as the engine's memory probe
  measures it (``measure_step_peak``: every allocation of the host thread and the lanes);
- the pinned gradient ring (``HOST_GRAD_RING`` buffers of the largest layer's gradient).

The rest is what a run needs beside the store that does not scale with the model:
``runtime_bytes`` = the step peak - store - device peak - ring (the Python runtime, torch,
the data, threads, the optimizer's and landing's scratch). At rest (after setup) the same
difference without the transient device peak is ``runtime_rest_bytes``. A checkpoint save is
measured last and apart (``ckpt_*``): its snapshot copies the groups it writes.

    python benchmarks/host_reserve.py [--rounds 3] [--steps 3]

prints one JSON object: each figure the median over the rounds, every round beside it, and
the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FLAVOR = "host-reserve-134m"
SEQ_LEN = 256


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _store_tensors(store):
    for b in store:
        yield from (b.master, b.remainder, b.grad, b.compute, b.copy_source)
        yield from (t for t in b.state.values() if hasattr(t, "untyped_storage"))
    yield store.arena


def _register_flavor() -> int:
    """A ~134M-parameter llama (12 layers of 768, MLP 2048, 32000-token vocabulary, untied) as
    a flavor the trainer can build; returns its largest layer's parameter count."""
    from layerwise.models import FLAVORS, Flavor

    FLAVORS[FLAVOR] = Flavor(FLAVOR, "llama", dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, vocab_size=32000, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False), "benchmarks/host_reserve.py")
    return 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768


def _config(out_dir: str, plan_path: str, steps: int):
    from layerwise import config as config_lib
    from layerwise.train.config import TrainConfig

    return config_lib.apply_overrides(TrainConfig(), [
        f"model={FLAVOR}", "model.compute_dtype=bfloat16", "model.tokenizer=byte",
        "device=cpu-async", f"plan={plan_path}", f"steps={steps}", f"seq_len={SEQ_LEN}",
        "micro_batch_size=1", "grad_accum=1", f"out_dir={out_dir}", "eval.every=0",
        "eval.batches=1", "ckpt.every=0", "ckpt.at_end=false", "log.every=1000",
        "log.track_every=0", "log.progress=lines", "export=false"])


def measure_round(steps: int) -> dict:
    """One round, in this process (run it in a fresh one: ``--round``)."""
    import torch

    from layerwise.engine.memory_probe import measure_step_peak
    from layerwise.plan import Plan
    from layerwise.train.loop import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    rss_start = _status_bytes("VmRSS")
    layer_params = _register_flavor()
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = str(Path(tmp) / "plan.json")
        Plan(["device", "recompute"] * 6, micro_batch_size=1, num_micro_batches=1, seq_len=SEQ_LEN,
             moments=["8bit"] * 14, source="benchmarks/host_reserve.py").save(plan_path)
        trainer = Trainer(_config(str(Path(tmp) / "run"), plan_path, steps))
        trainer.setup()
        engine, store = trainer.engine, trainer.store
        engine.synchronize()
        rss_setup, hwm_setup = _status_bytes("VmRSS"), _status_bytes("VmHWM")
        _reset_peak()
        record: dict = {}
        for step in range(steps):
            record, _ = trainer.train_step(step)
        engine.synchronize()
        hwm_steps, rss_steps = _status_bytes("VmHWM"), _status_bytes("VmRSS")
        store_bytes = _storage_bytes(_store_tensors(store))
        slot_bytes = engine.backend.allocated_bytes
        ring_bytes = _storage_bytes(engine.sink._ring.buffers)  # the sink does not expose its ring
        batch = [next(trainer.batches) for _ in range(trainer.accum)]
        device_peak = measure_step_peak(engine, batch).peak_bytes
        rows = [t for part in (trainer.data.train, trainer.data.eval)
                for t in (part.input_ids, part.labels, getattr(part, "segment_ids", None))]
        data_bytes = _storage_bytes(rows)
        data_tokens = sum(int(part.input_ids.numel()) for part in (trainer.data.train, trainer.data.eval))
        engine.synchronize()
        # a checkpoint save, apart: its snapshot copies the groups it writes
        trainer.cfg.ckpt.every = 1
        trainer._open_checkpoints()
        rss_before_save = _status_bytes("VmRSS")
        _reset_peak()
        trainer.save(steps, record)
        trainer.ckpt.wait()
        hwm_save = _status_bytes("VmHWM")
        trainer.close()
    num_params = sum(b.layout.numel for b in store)
    return {
        "num_params": num_params, "largest_layer_params": layer_params,
        "rss_start_bytes": rss_start, "rss_after_setup_bytes": rss_setup,
        "peak_setup_bytes": hwm_setup, "rss_after_steps_bytes": rss_steps,
        "peak_steps_bytes": hwm_steps, "store_alloc_bytes": store_bytes,
        "store_nbytes": store.nbytes(), "device_slot_bytes": slot_bytes,
        "device_step_peak_bytes": device_peak, "grad_ring_bytes": ring_bytes,
        "runtime_bytes": hwm_steps - store_bytes - device_peak - ring_bytes,
        "runtime_rest_bytes": rss_setup - store_bytes - slot_bytes - ring_bytes,
        "data_bytes": data_bytes, "data_tokens": data_tokens,
        "ckpt_snapshot_bytes": record.get("ckpt_snapshot_bytes"),
        "ckpt_save_peak_over_rest_bytes": hwm_save - rss_before_save,
        "step_s": trainer.step_times[-1] if trainer.step_times else None,
    }


def _child(steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    out = subprocess.run([sys.executable, __file__, "--round", "--steps", str(steps)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _loadavg() -> list[str]:
    return open("/proc/loadavg").read().split()[:3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps a round measures")
    ap.add_argument("--round", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.round:
        print(json.dumps(measure_round(args.steps)))
        return
    load_before = _loadavg()
    rounds = [_child(args.steps) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]
           if all(isinstance(r[k], (int, float)) for r in rounds)}
    print(json.dumps({
        "model": f"{FLAVOR} (llama, bf16 compute, 8-bit moments, cpu-async, 1 x {SEQ_LEN} tokens)",
        "rounds": args.rounds, "steps_per_round": args.steps,
        **{k: int(v) if float(v).is_integer() else v for k, v in med.items()},
        "runtime_bytes_max": max(r["runtime_bytes"] for r in rounds),
        "runtime_over_rss_start": round(med["runtime_bytes"] / med["rss_start_bytes"], 3),
        "data_bytes_per_token": round(med["data_bytes"] / med["data_tokens"], 3),
        "ckpt_snapshot_bytes_per_param": round(med["ckpt_snapshot_bytes"] / med["num_params"], 3),
        "ckpt_save_peak_over_snapshot": (round(med["ckpt_save_peak_over_rest_bytes"]
                                               / med["ckpt_snapshot_bytes"], 3)
                                         if med.get("ckpt_snapshot_bytes") else None),
        "load_average_before": load_before, "load_average_after": _loadavg(),
        "per_round": rounds,
    }))


if __name__ == "__main__":
    main()
