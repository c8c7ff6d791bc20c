"""A plain PyTorch model and its optimizer as a ``CheckpointSource`` (for export tests)."""

from __future__ import annotations

import json

from layerwise.models.names import group_of


class LiveModelSource:
    """A plain PyTorch model + AdamW(model.parameters()) as a CheckpointSource (one param group)."""

    def __init__(self, model, opt, step, scheduler=None):
        self.model, self.opt, self.step, self.scheduler = model, opt, step, scheduler
        self.named = dict(model.named_parameters())
        self.by_group: dict[str, list[str]] = {}
        for n in self.named:
            self.by_group.setdefault(group_of(n, model.config.tie_word_embeddings), []).append(n)

    def groups(self):
        return list(self.by_group)

    def load_group(self, group):
        out = {}
        for n in self.by_group[group]:
            p = self.named[n]
            out[f"param/{n}"] = p.detach().clone()
            for k, v in self.opt.state[p].items():
                out[f"{k}/{n}"] = v.detach().clone()
        return out

    def model_config(self):
        return self.model.config.to_dict()

    def extra_state(self):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        sched = None if self.scheduler is None else json.loads(json.dumps(self.scheduler.state_dict()))
        return {"step": self.step, "scheduler": sched, "rng": None, "trainer_state": None,
                "optimizer_param_groups": groups}
