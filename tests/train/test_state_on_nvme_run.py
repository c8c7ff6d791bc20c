"""``layerwise train`` with ``host_mem_gb`` below its store: state, and where that is not enough
weights and gradients, on NVMe; the same run as in RAM."""

import pytest
import torch
from safetensors.torch import load_file

from layerwise.cli import main
from layerwise.train.config import TrainConfig
from layerwise.train.loop import train

ARGS = dict(steps=3, seq_len=32, micro_batch_size=2, data={"corpus_tokens": 50_000},
            eval={"every": 0, "batches": 1}, log={"every": 100}, ckpt={"every": 0})


def _weights(result):
    [f] = result.model_dir.glob("*.safetensors")
    return load_file(f)


def test_a_run_with_its_weights_and_gradients_on_nvme_equals_the_run_in_ram(tmp_path, caplog):
    """``host_mem_gb`` so small that every unit's state and most units' weights and gradients
    go on NVMe (``nvme-all``): the exported weights equal the all-RAM run's bit for bit, the
    run says where its state went, and its state files are gone at the end.

    Mutation: the update staging the unit without ``write`` (``engine/updates.py``): the
    updated state is dropped with its slot and the weights differ."""
    ram = train(TrainConfig(out_dir=str(tmp_path / "ram"), **ARGS))
    with caplog.at_level("INFO"):
        nvme = train(TrainConfig(out_dir=str(tmp_path / "nvme"), host_mem_gb=0.0105, **ARGS))
    assert "the weights and gradients of" in caplog.text
    a, b = _weights(ram), _weights(nvme)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "nvme" / "nvme-state").exists()


@pytest.mark.parametrize("extra,needle", [
    (["host_mem_gb=0.001"], "even with every unit's state, weights and gradients on NVMe"),
    (["host_mem_gb=0.1", "lora.r=4"], "drop host_mem_gb"),
])
def test_a_host_mem_no_placement_meets_is_refused_in_one_line(tmp_path, capsys, extra, needle):
    code = main(["train", f"out_dir={tmp_path}", "steps=1", *extra])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
