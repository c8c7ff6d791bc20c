"""torchtitan's DCP saves (Llama names, Meta's RoPE row order) as sources, merged to HF and imported.

The saves are built here the way torchtitan's ``CheckpointManager`` writes them, with the same
torch calls on a module in torchtitan's Llama layout: the model's state dict flat at the top level
(older torchtitan: under ``model.``), ``optimizer`` holding
``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``'s keys and ``train_state.step``
an int32 tensor. The HF -> torchtitan transform is written from torchtitan's Llama3
``StateDictAdapter.from_hf`` (the name map and the q/k row order), as an index permutation,
independent of the reader's reshape.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import yaml
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from transformers import AutoModelForCausalLM

from layerwise.ckpt.resolve import open_run_step
from layerwise.cli import main
from layerwise.interop.sources import open_source
from layerwise.models.registry import FAMILIES, get_flavor
from live_source import LiveModelSource
from test_dcp import groups_equal, trained

TITAN = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
         "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
         "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
         "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
         "post_attention_layernorm": "ffn_norm"}


def to_titan_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    i, part = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf).groups()
    return f"layers.{i}.{TITAN[part]}.weight"


def to_titan_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's row ``c * half + j`` of a head is torchtitan's row ``2 * j + c``."""
    head_rows = t.shape[0] // heads
    half = head_rows // 2
    order = [h * head_rows + c * half + j for h in range(heads) for j in range(half) for c in range(2)]
    return t[torch.tensor(order)].clone()


def rope_heads(model) -> dict[str, int]:
    return {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}


def titan_module(model) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """torchtitan's Llama layout of ``model``'s weights (renamed, q/k rows reordered), as a module
    whose parameters come in the HF model's order; also HF name -> its parameter."""
    heads = rope_heads(model)
    root, by_hf = nn.Module(), {}
    for name, p in model.named_parameters():
        *path, leaf = to_titan_name(name).split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        proj = name.split(".")[-2]
        t = to_titan_rows(p.detach(), heads[proj]) if proj in heads else p.detach().clone()
        mod.register_parameter(leaf, nn.Parameter(t))
        by_hf[name] = getattr(mod, leaf)
    return root, by_hf


def titan_state(model, opt, step: int, prefix: str = "") -> dict:
    """What torchtitan's CheckpointManager hands to dcp.save: ``get_model_state_dict`` of its
    model (flat; older torchtitan: under ``model``), the optimizer's
    ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)`` under ``optimizer`` and its
    TrainState, for an AdamW over the torchtitan-layout module holding ``opt``'s moments."""
    tmod, by_hf = titan_module(model)
    hf_of = {id(p): n for n, p in model.named_parameters()}
    topt = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"},
                               "params": [by_hf[hf_of[id(p)]] for p in g["params"]]}
                              for g in opt.param_groups])
    heads = rope_heads(model)
    state = opt.state_dict()
    names = [hf_of[id(p)] for g in opt.param_groups for p in g["params"]]
    for i, st in state["state"].items():
        proj = names[i].split(".")[-2]
        if proj in heads:
            st = {k: (v if k == "step" else to_titan_rows(v, heads[proj])) for k, v in st.items()}
        state["state"][i] = {k: v.clone() for k, v in st.items()}
    topt.load_state_dict(state)
    # older torchtitan kept its RoPE buffer in the state dict
    weights = {**get_model_state_dict(tmod), "freqs_cis": torch.randn(16, 4)}
    optim = get_optimizer_state_dict(tmod, topt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**({"model": weights} if prefix else weights), "optimizer": optim,
            "train_state": {"step": torch.tensor(step, dtype=torch.int32),
                            "ntokens_seen": torch.tensor(step * 16, dtype=torch.int64)}}


def save_titan(model, opt, step: int, path, prefix: str = ""):
    dcp.save(titan_state(model, opt, step, prefix), checkpoint_id=path)
    return path


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(24).reshape(2, 12) % 96).logits


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    model, opt = trained(steps=3)
    root = tmp_path_factory.mktemp("titan")
    cfg_dir = root / "hf_config"
    model.config.save_pretrained(cfg_dir)
    return model, opt, save_titan(model, opt, 3, root / "step-3"), cfg_dir


@pytest.mark.parametrize("prefix", ["", "model."])
def test_torchtitan_save_reads_as_the_hf_model_exactly(titan, tmp_path, prefix):
    """Every group's weights and both moments equal the HF model's and optimizer's, bit for bit,
    with the weights flat (torchtitan today) or under ``model.`` (older torchtitan). Mutation seen
    failing: ``titan_rows_to_hf`` skipped in ``load_group`` (q_proj/k_proj weights and moments differ);
    ``rope_heads`` giving k_proj the query heads' count (4, not the 2 kv heads: k_proj differs)."""
    model, opt, path, cfg_dir = titan
    if prefix:
        path = save_titan(model, opt, 3, tmp_path / "step-3", prefix)
    src = open_source(path, config=cfg_dir / "config.json")
    assert src.layout == "torchtitan"
    assert groups_equal(LiveModelSource(model, opt, step=3), src) == []
    assert src.extra_state()["step"] == 3


def _rchar() -> int:
    """Bytes this process has read through read(2) & co. (``/proc/self/io``), page cache or not."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_reading_a_group_reads_that_group_only(tmp_path):
    """Reading one layer's group of a torchtitan save reads that group's bytes (weights and
    moments), DCP's metadata and a few buffer refills per tensor (DCP's reader seeks to each one),
    measured by the kernel's count of bytes this process read: a fraction of the save. Mutation
    seen failing: ``load_group`` requesting every tensor of the checkpoint."""
    torch.manual_seed(0)
    config = get_flavor("llama-debug").build_config(hidden_size=256, intermediate_size=512, head_dim=64)
    model = FAMILIES["llama"].model_class(config)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 96, (2, 8)), labels=torch.randint(0, 96, (2, 8))).loss.backward()
    opt.step()
    path = save_titan(model, opt, 1, tmp_path / "step-1")
    src = open_source(path, config=config.to_dict())
    total = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")
    before = _rchar()
    tensors = src.load_group("layers.1")
    read = _rchar() - before
    group = sum(t.numel() * t.element_size() for t in tensors.values())
    overhead = (path / ".metadata").stat().st_size + 64 * 1024 * len(tensors)
    assert group < read < group + overhead < total / 2, (group, read, overhead, total)


def test_torchtitan_model_only_last_save_reads_with_its_dir_step(titan, tmp_path):
    """torchtitan's last save (``last_save_model_only``, ``export_dtype``) holds only the weights,
    cast, flat: it reads as weights without moments, at the step its ``step-N`` dir names."""
    model, _, _, cfg_dir = titan
    tmod, _ = titan_module(model)
    path = tmp_path / "step-7"
    dcp.save({k: v.to(torch.bfloat16) for k, v in get_model_state_dict(tmod).items()}, checkpoint_id=path)
    src = open_source(path, config=cfg_dir)
    assert src.extra_state()["step"] == 7
    hf = dict(model.named_parameters())
    for g in src.groups():
        got = src.load_group(g)
        assert {k.split("/")[0] for k in got} == {"param"}
        for k, t in got.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, hf[k[len("param/"):]].to(torch.bfloat16)), k


def test_merge_hf_of_torchtitan_save_gives_the_original_logits(titan, tmp_path, capsys):
    """``ckpt merge --format hf --config`` of a torchtitan save loads in transformers and computes
    the original model's logits. The naive rename (no RoPE row order) is checked to differ, so the
    tiny model does see the permutation."""
    model, opt, path, cfg_dir = titan
    out = tmp_path / "hf"
    assert main(["ckpt", "merge", str(path), "--config", str(cfg_dir), "--out", str(out),
                 "--format", "hf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    back = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(back), logits(model))

    naive = AutoModelForCausalLM.from_config(model.config)
    state = titan_state(model, opt, 3)  # renamed and permuted, as saved
    naive.load_state_dict({n: state[to_titan_name(n)] for n, _ in naive.named_parameters()})
    assert not torch.allclose(logits(naive), logits(model), atol=1e-4)


def test_torchtitan_save_needs_a_config_and_checks_shapes_against_it(titan, tmp_path):
    model, _, path, cfg_dir = titan
    with pytest.raises(ValueError, match="--config"):
        open_source(path)
    wider = {**model.config.to_dict(), "intermediate_size": 128}
    with pytest.raises(ValueError, match=r"feed_forward.w1.weight' is \[64, 32\].*\[128, 32\]"):
        open_source(path, config=wider)
    with pytest.raises(ValueError, match="no such file"):
        open_source(path, config=tmp_path / "missing")


def test_tied_config_reads_a_tied_torchtitan_run_and_refuses_an_untied_one(titan, tmp_path):
    """A tied HF config drops torchtitan's ``output.weight`` (as torchtitan's own conversion of a
    tied model does), after checking it equals the embedding. Mutation seen failing: the check
    removed from ``load_group`` (the untied run reads, its output layer silently lost)."""
    model, _, _, cfg_dir = titan
    tied = {**model.config.to_dict(), "tie_word_embeddings": True}
    tmod, _ = titan_module(model)
    weights = get_model_state_dict(tmod)
    dcp.save(weights, checkpoint_id=tmp_path / "untied")
    with pytest.raises(ValueError, match="output.weight differs from tok_embeddings.weight"):
        open_source(tmp_path / "untied", config=tied).load_group("embed")
    dcp.save({**weights, "output.weight": weights["tok_embeddings.weight"]}, checkpoint_id=tmp_path / "tied")
    src = open_source(tmp_path / "tied", config=tied)
    assert "lm_head" not in src.groups()
    assert torch.equal(src.load_group("embed")["param/model.embed_tokens.weight"],
                       model.model.embed_tokens.weight)


def test_dcp_of_unknown_names_is_refused_naming_what_it_holds(titan, tmp_path):
    model, _, _, cfg_dir = titan
    other = tmp_path / "other"
    dcp.save({"encoder.block.0.weight": torch.zeros(2), "decoder.head.weight": torch.zeros(2)},
             checkpoint_id=other)
    with pytest.raises(ValueError, match="not in the checkpoint.*decoder.head.weight, encoder.block.0.weight"):
        open_source(other, config=cfg_dir)


def test_import_and_recipe_of_torchtitan_saves(titan, tmp_path, capsys):
    """``ckpt import --config`` takes torchtitan saves (their ``train_state.step`` as the step) and
    each step resolves to its model; a recipe with ``config:`` takes layers from both saves."""
    model, opt, first, cfg_dir = titan
    live = LiveModelSource(model, opt, step=3)
    before = {g: live.load_group(g) for g in live.groups()}
    later_model, later_opt = trained(steps=5)
    second = save_titan(later_model, later_opt, 5, tmp_path / "step-5")
    run = tmp_path / "run"
    assert main(["ckpt", "import", str(second), str(first), "--run", str(run), "--config",
                 str(cfg_dir), "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)["steps"]] == [3, 5]
    assert groups_equal(LiveModelSource(later_model, later_opt, step=5), open_run_step(run, 5)) == []
    at3 = open_run_step(run, 3)
    assert all(torch.equal(t, at3.load_group(g)[k]) for g, ts in before.items() for k, t in ts.items())

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"config": str(cfg_dir), "slices": [
        {"sources": [{"model": str(first), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(second), "layer_range": [2, 4]}]}]}))
    out = tmp_path / "merged"
    assert main(["ckpt", "merge", "--recipe", str(recipe), "--out", str(out), "--json"]) == 0
    merged = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for n, p in merged.items():
        want = model if ".layers.0." in n or ".layers.1." in n or "embed" in n else later_model
        assert torch.equal(p, dict(want.named_parameters())[n]), n
