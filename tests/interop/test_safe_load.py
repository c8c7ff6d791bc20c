"""Foreign ``.pt`` files are read as data: a pickle that would run code is refused, with the
class named, and nothing runs; the Trainer's real files still load."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource, load_trainer_rng
from layerwise.util.safe_load import load_data_file
from trainer_helpers import make_trainer


class RunsCode:
    """Unpickling this calls ``os.system`` (what a hostile checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hf_run")
    make_trainer(run, max_steps=2).train()
    return run / "checkpoint-2"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the plain pickle below
def test_a_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path):
    """Mutation this fails on (made once, by hand): ``weights_only=False`` in ``load_data_file``
    (the marker file is created: the pickle ran ``os.system``)."""
    marker = tmp_path / "ran"
    evil = tmp_path / "optimizer.pt"
    torch.save({"state": {0: RunsCode(marker)}, "param_groups": []}, evil)
    with pytest.raises(ValueError, match=r"needs (posix|os)\.system to load.*does not allow"):
        load_data_file(evil)
    with pytest.raises(ValueError, match="system"):
        load_data_file(evil, mmap=True)
    legacy = tmp_path / "legacy.pt"  # the pre-zip format takes the other load path
    torch.save(RunsCode(marker), legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="system"):
        load_data_file(legacy, mmap=True)
    plain = tmp_path / "plain.pkl"  # not a torch file: torch's unpickler stops before the GLOBAL
    plain.write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError, match="not plain data"):
        load_data_file(plain)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state.pth", "optimizer.pt"])
def test_a_trainer_checkpoint_with_a_hostile_file_is_refused(checkpoint, tmp_path, name):
    ck = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoint, ck)
    marker = tmp_path / "ran"
    torch.save({"x": RunsCode(marker)}, ck / name)
    with pytest.raises(ValueError, match="system"):
        src = TrainerCheckpointSource(ck)
        src.extra_state()
        src.load_group("layers.0")
    assert not marker.exists()


def test_real_trainer_files_load(checkpoint):
    """The Trainer's own files hold only allowed classes: numpy RNG state included."""
    src = TrainerCheckpointSource(checkpoint)
    extra = src.extra_state()
    assert extra["step"] == 2 and extra["scheduler"] is not None
    rng = load_trainer_rng(checkpoint / "rng_state.pth")
    assert isinstance(rng["numpy"][1], np.ndarray)
    assert any(k.startswith("exp_avg/") for k in src.load_group("layers.0"))
