"""HF model dirs as sources, the streaming safetensors writer, atomic and streaming export."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import multiproc
from layerwise.cli import main
from layerwise.util.units import parse_size_bytes
from layerwise.util.safetensors_io import ShardedSafetensorsWriter
from layerwise.interop.recipes.merge import merge
from layerwise.interop.hf.model_dir import HFModelDirSource
from layerwise.interop.sources import open_source
from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource
from layerwise.models.registry import FAMILIES, get_flavor
from live_source import LiveModelSource


def tiny_model(flavor: str = "llama-debug", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    family = get_flavor(flavor).family
    return FAMILIES[family].model_class(get_flavor(flavor).build_config(**overrides))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    model = tiny_model()
    path = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(path)
    return model, path


def logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x).logits


def test_streaming_writer_output_reads_with_safetensors(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=100, header_reserve_bytes=1024)
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.randn(5, dtype=torch.bfloat16),
        "c": torch.tensor(3.0),  # 0-d
        "d": torch.tensor([True, False, True]),
        "e": torch.arange(40, dtype=torch.int64),  # 320 bytes: a shard of its own, over the limit
    }
    for k, t in tensors.items():
        w.add(k, t)
    weight_map = w.finish("model.safetensors", "model-{:05d}-of-{:05d}.safetensors")
    files = sorted(set(weight_map.values()))
    assert files == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert weight_map["e"] == files[1]
    assert not list(tmp_path.glob(".shard-*"))
    for name, t in tensors.items():
        with safe_open(str(tmp_path / weight_map[name]), framework="pt") as f:
            got = f.get_tensor(name)
            assert f.metadata() == {"format": "pt"}
        assert got.dtype == t.dtype and torch.equal(got, t)


def test_streaming_writer_rolls_over_when_header_is_full(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=None, header_reserve_bytes=256)
    for i in range(10):
        w.add(f"tensor.number.{i}", torch.full((2,), float(i)))
    weight_map = w.finish("model.safetensors", "model-{:05d}-of-{:05d}.safetensors")
    assert len(set(weight_map.values())) > 1
    for name, file in weight_map.items():
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert f.get_tensor(name)[0].item() == float(name.rsplit(".", 1)[1])


def test_parse_size_bytes():
    assert parse_size_bytes("5GB") == 5 * 10**9
    assert parse_size_bytes("2GiB") == 2 * 2**30
    assert parse_size_bytes("500 MB") == 500 * 10**6
    assert parse_size_bytes(123) == 123 and parse_size_bytes(None) is None
    with pytest.raises(ValueError, match="write it like 5GB"):
        parse_size_bytes("five gigs")


def test_hf_dir_source_groups_and_reexport(hf_dir, tmp_path):
    model, path = hf_dir
    src = open_source(path)
    assert isinstance(src, HFModelDirSource) and not isinstance(src, TrainerCheckpointSource)
    assert src.groups() == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]
    layer = src.load_group("layers.2")
    assert set(layer) == {f"param/{n}" for n, _ in model.named_parameters() if n.startswith("model.layers.2.")}
    assert src.extra_state()["step"] == 0 and src.model_config()["model_type"] == "llama"
    # Sharded in, sharded out: the index maps every tensor, and the model loads with equal logits.
    out1 = tmp_path / "sharded"
    merge(path, out1, format="hf", max_shard_size="30KB")
    index = json.loads((out1 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in model.named_parameters()}
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    out2 = tmp_path / "again"
    merge(out1, out2, format="hf")
    assert [p.name for p in sorted(out2.glob("*.safetensors"))] == ["model.safetensors"]
    x = torch.randint(0, 96, (2, 8))
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out2), x), logits(model, x))


def test_pytorch_bin_source(tmp_path):
    model = tiny_model("qwen2-debug")  # tied embeddings, biases in attention
    model.save_pretrained(tmp_path / "bin")
    sd = {k: v for k, v in model.state_dict().items()}
    for f in (tmp_path / "bin").glob("*.safetensors"):
        f.unlink()
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    src = open_source(tmp_path / "bin")
    assert "lm_head" not in src.groups()  # tied: the head is the embedding
    merge(src, tmp_path / "out", format="hf")
    x = torch.randint(0, 96, (1, 8))
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), x), logits(model, x))


def test_open_source_errors(hf_dir, tmp_path):
    _, path = hf_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_source(tmp_path / "nope")
    with pytest.raises(ValueError, match="holds a single step"):
        open_source(path, step=3)
    with pytest.raises(ValueError, match="must be a step number"):
        open_source(f"{tmp_path}/nope@latest")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        open_source(tmp_path / "empty")


class FailingSource:
    """Delegates to a real source and fails while reading the ``fail_at``-th group."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def groups(self):
        return self.inner.groups()

    def load_group(self, group):
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(28, "No space left on device (simulated)")
        return self.inner.load_group(group)

    def model_config(self):
        return self.inner.model_config()

    def extra_state(self):
        return self.inner.extra_state()


@pytest.mark.parametrize("fmt", ["hf", "trainer"])
def test_failed_export_leaves_nothing_and_keeps_previous_output(hf_dir, tmp_path, fmt):
    _, path = hf_dir
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        merge(FailingSource(open_source(path), fail_at=4), out, format=fmt, max_shard_size="20KB")
    assert list(tmp_path.iterdir()) == []  # no output, no temp dir left behind

    # A previous output survives a failed --overwrite, and a good --overwrite replaces it whole.
    merge(path, out, format=fmt)
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    with pytest.raises(OSError):
        merge(FailingSource(open_source(path), fail_at=2), out, format=fmt, overwrite=True)
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(ValueError, match="not empty"):
        merge(path, out, format=fmt)
    merge(path, out, format=fmt, overwrite=True, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["out"]


class CountingSource:
    """Tracks how many loaded groups are still alive while a merge runs."""

    def __init__(self, inner):
        self.inner, self.alive, self.peak = inner, 0, 0

    def groups(self):
        return self.inner.groups()

    def _dead(self):
        self.alive -= 1

    def load_group(self, group):
        gc.collect()
        tensors = self.inner.load_group(group)
        for t in tensors.values():
            self.alive += 1
            weakref.finalize(t, self._dead)
        self.peak = max(self.peak, self.alive)
        return tensors

    def model_config(self):
        return self.inner.model_config()

    def extra_state(self):
        return self.inner.extra_state()


@pytest.mark.parametrize("fmt", ["hf", "trainer"])
def test_export_streams_one_group_at_a_time(hf_dir, tmp_path, fmt):
    model, path = hf_dir
    src = CountingSource(open_source(path))
    merge(src, tmp_path / "out", format=fmt)
    largest_group = max(len(src.inner.load_group(g)) for g in src.groups())
    # Only the group being written (all earlier ones were released).
    assert src.peak <= largest_group


def test_trainer_export_from_a_plain_loop_state(tmp_path):
    from layerwise.interop.hf.trainer_checkpoint import trainer_param_groups

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95))
    for _ in range(3):
        model(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path / "checkpoint-3"
    summary = merge(LiveModelSource(model, opt, 3), out, format="trainer")
    assert summary["step"] == 3 and not summary["rng_state"]
    sd = torch.load(out / "optimizer.pt", weights_only=True)
    g0, g1 = sd["param_groups"]
    assert (g0["weight_decay"], g1["weight_decay"]) == (0.05, 0.0)
    assert g0["lr"] == g1["lr"] == 3e-3 and g0["betas"] == g1["betas"] == (0.8, 0.95)
    decay, no_decay = trainer_param_groups(model)
    assert all("norm" in n for n in no_decay) and len(decay) + len(no_decay) == len(list(model.parameters()))
    named = dict(model.named_parameters())
    for i, name in enumerate(decay + no_decay):
        assert i in g0["params"] + g1["params"]
        assert torch.equal(sd["state"][i]["exp_avg"], opt.state[named[name]]["exp_avg"]), name
        assert sd["state"][i]["step"].item() == 3.0
    sched = torch.load(out / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == 3 and sched["base_lrs"] == [3e-3, 3e-3]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    assert not (out / "rng_state.pth").exists()

    # The loop's own one-group scheduler is spread over Trainer's two groups.
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    out2 = tmp_path / "with-scheduler"
    merge(LiveModelSource(model, opt, 3, scheduler=lam), out2, format="trainer")
    sched = torch.load(out2 / "scheduler.pt", weights_only=True)
    assert sched["base_lrs"] == [3e-3, 3e-3] and sched["_last_lr"] == [1.5e-3, 1.5e-3]
    assert len(sched["lr_lambdas"]) == 2


def _merge_under_a_file_size_limit(rank: int, argv: list[str], limit_bytes: int) -> None:
    """``layerwise <argv>`` in a child whose writes past ``limit_bytes`` fail with EFBIG."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    code = main(argv)
    if code:
        raise SystemExit(code)


def test_cli_export_out_of_space_fails_cleanly(hf_dir, tmp_path):
    """A write that hits the file-size limit (as a full disk would) exits 1 and leaves no output
    (the CLI in a child process, forked by ``multiproc``, whose file-size limit is 40 kB)."""
    _, path = hf_dir
    out, logs = tmp_path / "out", tmp_path.parent / f"{tmp_path.name}-logs"
    argv = ["ckpt", "merge", str(path), "--out", str(out), "--format", "trainer", "--json"]
    logs.mkdir()
    with multiproc.start(_merge_under_a_file_size_limit, (argv, 40_000), 1, log=logs / "merge",
                         stores=[], split_stderr=True) as launch:
        assert launch[0].wait(120) == 1, launch.logs()
    err = json.loads(launch[0].log_tail(100_000).strip().splitlines()[-1])
    assert err["ok"] is False and "nothing was written" in err["error"] and "File too large" in err["error"]
    assert list(tmp_path.iterdir()) == []
