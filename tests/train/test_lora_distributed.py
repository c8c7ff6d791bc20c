"""LoRA and QLoRA under torchrun (gloo, 2 CPU processes, ``dist_child.py``): adapters reduced to
their owners, one shared host store (the frozen base included) per node, each rank writing its
checkpoint groups, rank 0 exporting the PEFT adapter. Compared with one process of the same
global batch (2 ranks x 1 row against 1 process x 2 rows, 2 micro-batches a step). Dropout is
off: a rank draws its masks over its own rows, so with ``lora.dropout > 0`` the masks differ from
one process's (``docs/design-notes.md``)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from layerwise.adapters.config import LoraConfig
from layerwise.adapters.lora_store import init_lora_store
from layerwise.interop.hf.model_dir import load_config
from layerwise.train.dist.saving import group_writers

from .test_distributed import _creators, _launch, _run
from .tiny_hf import make_model_dir

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
STEPS = 6
LORA = ["lora.r=4", "lora.alpha=8", "lora.dropout=0"]
KINDS = {"lora": [], "qlora": ["lora.base_dtype=nf4"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch (a LoRA run, then a QLoRA run, checkpoints at steps 3 and 6), and the
    single-process references, which run here while the ranks run."""
    tmp = tmp_path_factory.mktemp("lora_dist")
    base = make_model_dir(tmp / "base")
    common = [f"model={base}", f"steps={STEPS}", "grad_accum=2", "ckpt.every=3",
              "ckpt.policy=full", *LORA]
    shm_dir = Path("/dev/shm") / f"layerwise-test-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    try:
        two = [{"overrides": [f"out_dir={tmp / f'r2_{k}'}", *common, *extra, "micro_batch_size=1",
                              f"dist.shm_dir={shm_dir}"]} for k, extra in KINDS.items()]
        with _launch(tmp, two) as ranks:
            for k, extra in KINDS.items():
                _run(tmp / f"p1_{k}", *common, *extra, "micro_batch_size=2")
            ranks.wait(timeout_s=400)
        yield dict(tmp=tmp, base=base)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_ranks_train_the_adapters_one_process_does(runs, kind):
    """6 steps of 2 ranks x 1 row give the adapters (and losses) of 1 process x 2 rows: max abs
    diff <= 1e-5 (measured ~4e-7, the adapters' B ~1e-2, with the base in the compute dtype
    and in NF4, quantised the same on every rank).

    Mutations seen failing: ``DistReducer.reduce_on_device`` reducing nothing (each owner steps
    on its own rank's gradient: diff ~2e-2); ``build_lora`` without the run's allocator (a
    private ``LoraStore`` per rank: each sees only its own units' updates, diff ~1e-2)."""
    tmp = runs["tmp"]
    one, two = _adapter(tmp / f"p1_{kind}"), _adapter(tmp / f"r2_{kind}")
    assert one.keys() == two.keys() and one
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert diff <= 1e-5, diff
    rows = [[json.loads(x) for x in (tmp / f"{p}_{kind}" / "metrics.jsonl").read_text().splitlines()]
            for p in ("p1", "r2")]
    assert len(rows[0]) == len(rows[1]) == STEPS
    for a, b in zip(*rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_rank_0_exports_an_adapter_peft_loads(runs, kind):
    """The 2-rank run's ``out_dir/adapter`` loads with ``PeftModel.from_pretrained`` on the base
    model directory, holding the adapters rank 0 exported."""
    out = runs["tmp"] / f"r2_{kind}"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["base"]),
                                     out / "adapter")
    loaded = get_peft_model_state_dict(peft)
    exported = _adapter(out)
    assert len(loaded) == len(exported)
    assert all(torch.equal(loaded[k], exported[k]) for k in exported)


def test_each_rank_writes_its_adapter_groups(runs):
    """Both saves of the 2-rank LoRA run hold the layers' groups alone, each written by the rank
    ``group_writers`` deals it to (told by the blob files' modes), both ranks writing some."""
    _, store = init_lora_store(load_config(runs["base"]), LoraConfig(r=4, alpha=8))
    expected = group_writers(store, 2)
    assert set(expected.values()) == {0, 1} and all(g.startswith("layers.") for g in expected)
    got = _creators(runs["tmp"] / "r2_lora" / "ckpt")
    assert list(got) == [3, 6]
    for step, creators in got.items():
        assert creators == expected, (step, creators)
