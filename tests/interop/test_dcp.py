"""torch.distributed.checkpoint: ``merge --format dcp``, DCP dirs as sources, FSDP2 loading them."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from layerwise.ckpt.resolve import open_run_step
from layerwise.cli import main
from layerwise.interop.torchdist.dcp_checkpoint import DCPCheckpointSource
from layerwise.interop.recipes.import_checkpoints import import_checkpoints
from layerwise.interop.recipes.merge import merge
from layerwise.interop.sources import open_source
from layerwise.interop.hf.trainer_checkpoint import trainer_param_groups
from layerwise.models.registry import FAMILIES, get_flavor
import multiproc
from live_source import LiveModelSource


def trained(steps: int = 3, seed: int = 0):
    """A tiny Llama and its AdamW (two Trainer-style groups) after a few steps."""
    torch.manual_seed(seed)
    model = FAMILIES["llama"].model_class(get_flavor("llama-debug").build_config())
    named = dict(model.named_parameters())
    decay, no_decay = trainer_param_groups(model)
    opt = torch.optim.AdamW([{"params": [named[n] for n in decay], "weight_decay": 0.1},
                             {"params": [named[n] for n in no_decay], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.8, 0.95))
    for _ in range(steps):
        model(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def groups_equal(a, b) -> list[str]:
    """Keys (group/tensor) where two sources differ; empty when every group is bit-identical."""
    assert a.groups() == b.groups()
    bad = []
    for g in a.groups():
        ta, tb = a.load_group(g), b.load_group(g)
        if set(ta) != set(tb):
            bad.append(f"{g}: keys {sorted(set(ta) ^ set(tb))}")
        bad += [f"{g}/{k}" for k in ta if k in tb and not torch.equal(ta[k], tb[k].to(ta[k].dtype))]
    return bad


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, opt = trained()
    src = LiveModelSource(model, opt, step=3)
    out = tmp_path_factory.mktemp("dcp") / "ckpt"
    summary = merge(src, out, format="dcp")
    return model, opt, src, out, summary


def test_dcp_round_trip_is_exact_and_streams_group_by_group(exported):
    """Weights, both moments and the step survive DCP exactly, and the writer reads each source
    group once while writing (one group in memory). Mutation seen failing: ``thread_count=2`` in
    ``write_dcp`` (DCP then writes the largest tensors first: 26 group loads for 7 groups)."""
    model, opt, src, out, summary = exported
    assert summary["format"] == "dcp" and summary["step"] == 3
    assert summary["group_loads"] == summary["groups"] == len(src.groups())
    back = open_source(out)
    assert isinstance(back, DCPCheckpointSource)
    assert groups_equal(src, back) == []
    assert back.extra_state()["step"] == 3


def test_dcp_export_loads_into_plain_model_with_get_state_dict(exported):
    """The nesting is get_state_dict's: a plain (non-distributed) model and optimizer load it with
    dcp.load + set_state_dict and then hold the source's weights, moments and hyper-parameters."""
    model, opt, _, out, _ = exported
    fresh, fresh_opt = trained(steps=0, seed=1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=out)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"]), n
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.1, 0.0]
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)


def _fsdp2_load(rank: int, ckpt: str, config: dict, result: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = dict(config)
    model = AutoModelForCausalLM.from_config(
        FAMILIES["llama"].model_class.config_class(**cfg))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    named = dict(model.named_parameters())
    decay, no_decay = trainer_param_groups(model)
    opt = torch.optim.AdamW([{"params": [named[n] for n in decay]},
                             {"params": [named[n] for n in no_decay]}], lr=1.0)
    msd, osd = get_state_dict(model, opt)
    shard_rows = next(iter(msd.values())).to_local().shape[0]
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    full_m, full_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True))
    if rank == 0:
        torch.save({"model": full_m, "optim": full_o, "shard_rows": shard_rows}, result)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dcp_export_loads_into_two_process_fsdp2(exported, tmp_path):
    """Two gloo processes, each holding half of every parameter (FSDP2), load the export with
    dcp.load: gathered back, weights and moments equal the source's. Mutation seen failing:
    ``exp_avg`` and ``exp_avg_sq`` swapped in ``_MOMENTS`` (a DCP round trip alone cannot see it)."""
    model, opt, _, out, _ = exported
    result = tmp_path / "loaded.pt"
    multiproc.run(_fsdp2_load, (str(out), model.config.to_dict(), str(result)), log=tmp_path / "rank")
    got = torch.load(result, weights_only=True)
    named = dict(model.named_parameters())
    assert got["shard_rows"] < named["model.embed_tokens.weight"].shape[0]  # really sharded
    for n, p in named.items():
        assert torch.equal(got["model"][n], p.detach()), n
        assert torch.equal(got["optim"]["state"][n]["exp_avg"], opt.state[p]["exp_avg"]), n
        assert torch.equal(got["optim"]["state"][n]["exp_avg_sq"], opt.state[p]["exp_avg_sq"]), n


def test_flat_torchtitan_style_dcp_reads_as_source_and_exports_to_hf(exported, tmp_path):
    """A DCP dir written by another loop (model keys at the top level, the optimizer flattened
    as ``state.<fqn>.<field>``) reads as a source; its HF export equals the model."""
    model, opt, src, _, _ = exported
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    foreign = tmp_path / "titan"
    dcp.save({**msd, **osd}, checkpoint_id=foreign)
    with pytest.raises(ValueError, match="config.json"):
        open_source(foreign)
    (foreign / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert groups_equal(src, open_source(foreign)) == []
    hf = tmp_path / "hf"
    merge(foreign, hf, format="hf")
    back = AutoModelForCausalLM.from_pretrained(hf)
    for (n, p), q in zip(model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), n


def test_dcp_of_another_model_is_refused(exported, tmp_path):
    _, _, _, out, _ = exported
    other = tmp_path / "other"
    shutil.copytree(out, other)
    bigger = get_flavor("llama-debug").build_config(num_hidden_layers=9).to_dict()
    (other / "config.json").write_text(json.dumps(bigger))
    with pytest.raises(ValueError, match="not in the checkpoint"):
        DCPCheckpointSource(other)


def test_cli_merge_to_dcp(exported, tmp_path, capsys):
    _, _, _, out, _ = exported
    dst = tmp_path / "again"
    assert main(["ckpt", "merge", str(out), "--out", str(dst), "--format", "dcp", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["format"] == "dcp" and (dst / ".metadata").is_file()
    assert groups_equal(open_source(out), open_source(dst)) == []


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_that_would_run_code_is_refused(exported, tmp_path):
    """DCP itself unpickles ``.metadata`` with plain pickle; a source reads it with an allow-list.
    Mutation seen failing: ``_DataOnlyReader`` falling back to ``pickle.load`` (the marker file
    appears)."""
    _, _, _, out, _ = exported
    evil = tmp_path / "evil"
    shutil.copytree(out, evil)
    marker = tmp_path / "ran"
    (evil / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ValueError, match="system.*not a DCP metadata class"):
        open_source(evil)
    assert not marker.exists()


def test_import_of_dcp_exports_resolves_to_each(tmp_path):
    """``ckpt import`` takes DCP dirs (step from ``train_state.step``): two exports of one run,
    three steps apart, resolve back to themselves."""
    model, opt = trained(steps=2)
    first = merge(LiveModelSource(model, opt, step=2), tmp_path / "a", format="dcp")["out"]
    for _ in range(3):
        model(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
        opt.step()
        opt.zero_grad()
    second = merge(LiveModelSource(model, opt, step=5), tmp_path / "b", format="dcp")["out"]
    import_checkpoints([second, first], tmp_path / "run", policy="full")
    for step, path in ((2, first), (5, second)):
        assert groups_equal(open_source(path), open_run_step(tmp_path / "run", step)) == []
