"""The streaming engine's HostStore as a checkpoint ``StateProvider``.

Weights, gradients and optimizer moments are served as views into the store's flat per-unit
buffers, so a checkpoint snapshot is one copy from the host store and a load writes straight
back into it. 8-bit moments are converted to fp32 AdamW state on the way out (and back on the
way in) by their optimizer, so a layer-wise checkpoint is the same whichever moments trained it.
Call ``engine.synchronize()`` first: a pending update would otherwise race the snapshot.
"""

from __future__ import annotations

import torch

from ..store import HostStore, UnitBuffers
from ..models.names import group_of

MOMENTS = ("exp_avg", "exp_avg_sq")


class HostStoreStateProvider:
    def __init__(self, store: HostStore, optimizers: dict[str, object] | None = None):
        self.store = store
        self.optimizers = optimizers or {}
        tied = store.adapter.tied
        self._where: dict[str, tuple[UnitBuffers, str]] = {}  # hf name -> (unit buffers, local)
        self._groups: dict[str, list[str]] = {}
        for buf in store:
            for p in buf.unit.params:
                self._where[p.hf_name] = (buf, p.local)
                self._groups.setdefault(group_of(p.hf_name, tied), []).append(p.hf_name)

    def _units(self, group: str) -> dict[str, UnitBuffers]:
        return {self._where[n][0].name: self._where[n][0] for n in self._groups[group]}

    def group_names(self) -> dict[str, list[str]]:
        return self._groups

    def _views(self, group: str, flat_of) -> dict[str, torch.Tensor]:
        out = {}
        for n in self._groups[group]:
            buf, local = self._where[n]
            flat = flat_of(buf)
            if flat is not None:
                out[n] = buf.layout.views(flat)[local]
        return out

    def params(self, group: str) -> dict[str, torch.Tensor]:
        return self._views(group, lambda b: b.master)

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        return self._views(group, lambda b: b.grad)

    def _fp32_state(self, buf: UnitBuffers) -> dict[str, torch.Tensor]:
        opt = self.optimizers.get(buf.name)
        convert = getattr(opt, "to_fp32_state", None)
        return convert(buf.state) if convert is not None else buf.state

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        states = {u: self._fp32_state(b) for u, b in self._units(group).items()}
        for n in self._groups[group]:
            buf, local = self._where[n]
            st = states[buf.name]
            if not st or float(st["step"]) == 0:
                continue  # no step taken yet: like torch.optim, there is no state to save
            for k in MOMENTS:
                out[f"{k}/{n}"] = buf.layout.views(st[k])[local]
            out[f"step/{n}"] = st["step"].reshape(())
        return out

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        names = self._groups.get(group)
        if names is None:
            raise ValueError(f"checkpoint group {group!r} does not exist in this model")
        known = {f"{k}/{n}" for n in names for k in ("param", *MOMENTS, "step")}
        extra = set(tensors) - known
        if extra:
            raise ValueError(f"checkpoint group {group!r} has unexpected tensors {sorted(extra)[:3]}")
        for unit, buf in self._units(group).items():
            fp32 = {k: v.clone() for k, v in self._fp32_state(buf).items()} if buf.state else {}
            for n in names:
                b, local = self._where[n]
                if b is not buf:
                    continue
                w = tensors.get(f"param/{n}")
                if w is None:
                    raise ValueError(f"checkpoint group {group!r} has no weights for {n!r}")
                view = buf.layout.views(buf.master)[local]
                if tuple(w.shape) != tuple(view.shape):
                    raise ValueError(f"{n}: checkpoint shape {tuple(w.shape)} != model shape "
                                     f"{tuple(view.shape)}; saved from a different configuration")
                view.copy_(w)
                if not fp32:
                    continue
                if f"step/{n}" in tensors:
                    for k in MOMENTS:
                        buf.layout.views(fp32[k])[local].copy_(tensors[f"{k}/{n}"])
                    fp32["step"].copy_(tensors[f"step/{n}"].reshape(()))
                else:  # saved before any step: fresh moments
                    for k in MOMENTS:
                        buf.layout.views(fp32[k])[local].zero_()
                    fp32["step"].zero_()
            if fp32:
                opt = self.optimizers.get(unit)
                back = getattr(opt, "from_fp32_state", None)
                new_state = back(fp32) if back is not None else fp32
                for k, v in new_state.items():
                    buf.state[k].copy_(v)
            buf.refresh_compute()

    def model_config(self) -> dict | None:
        return self.store.adapter.config.to_dict()
