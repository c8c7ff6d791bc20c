"""Shared helpers for the checkpoint core tests: a tiny Llama, a training step, snapshots."""

from __future__ import annotations

import torch

from layerwise.ckpt.provider import ModuleStateProvider, group_tensors
from layerwise.models.registry import FAMILIES, get_flavor


def tiny_llama(seed: int = 0, flavor: str = "llama-debug"):
    torch.manual_seed(seed)
    cfg = get_flavor(flavor).build_config()
    return FAMILIES["llama"].model_class(cfg)


def make_training(seed: int = 0, lr: float = 1e-2, flavor: str = "llama-debug"):
    model = tiny_llama(seed, flavor)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def train_step(model, opt, sched, vocab: int = 96) -> None:
    """One step on a batch drawn from the global torch RNG (so RNG restore matters)."""
    x = torch.randint(0, vocab, (2, 12))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def snapshot(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    prov = ModuleStateProvider(model, opt)
    return {g: {k: t.detach().clone().float() if not k.startswith("param/") else t.detach().clone()
                for k, t in group_tensors(prov, g).items()}
            for g in prov.group_names()}


def assert_group_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        a, b = got[k].float().reshape(-1), want[k].float().reshape(-1)
        assert torch.equal(a, b), f"{what}: {k} differs"
