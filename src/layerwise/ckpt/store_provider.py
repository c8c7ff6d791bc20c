"""The streaming engine's HostStore as a checkpoint ``StateProvider``.

Views into the store's flat buffers, so a snapshot is one copy and a load writes straight back.
A split master is decoded to fp32 per group and split again on load (exactly), so checkpoints
always hold the fp32 master. 8-bit moments go as codes and scales; a stored version in the other
moment format is converted. Call ``engine.synchronize()`` first, or a pending update races the
snapshot. NVMe-tier units are staged while read or written."""

from __future__ import annotations

import torch

from ..store import HostStore, UnitBuffers
from ..models.names import group_of
from .moments import Q8_KINDS, UNIT_KEYS, fits_unit, fp32_moments, unit_part, write_unit_part

MOMENTS = ("exp_avg", "exp_avg_sq")
PASSTHROUGH = "passthrough"
"""The group of what the store carries untrained (``HostStore.passthrough``: a multimodal
model's vision tower and projector): no gradient, no optimizer state, saved as read, so a
checkpoint holds the whole model (its first save writes it; later ones find it unchanged)."""


class HostStoreStateProvider:
    def __init__(self, store: HostStore, optimizers: dict[str, object] | None = None):
        self.store = store
        self.optimizers = optimizers or {}
        tied = store.adapter.tied
        self._where: dict[str, tuple[UnitBuffers, str]] = {}  # hf name -> (unit buffers, local)
        self._groups: dict[str, list[str]] = {}
        self._span: dict[str, tuple[int, int]] = {}  # hf name -> (offset, numel) in its unit
        for buf in store:
            for p in buf.unit.params:
                self._where[p.hf_name] = (buf, p.local)
                self._groups.setdefault(group_of(p.hf_name, tied), []).append(p.hf_name)
            for spec, offset in zip(buf.layout.specs, buf.layout.offsets):
                self._span[spec.hf_name] = (offset, spec.numel)
        if getattr(store, "passthrough", None):  # (a LoRA store checkpoints its adapters only)
            self._groups[PASSTHROUGH] = list(store.passthrough)

    def _units(self, group: str) -> dict[str, UnitBuffers]:
        return {self._where[n][0].name: self._where[n][0] for n in self._groups[group]}

    def group_names(self) -> dict[str, list[str]]:
        return self._groups

    def params(self, group: str) -> dict[str, torch.Tensor]:
        """fp32 weights by HF name: views of plain masters, fresh fp32 copies of split ones
        (one group's worth at a time); the passthrough tensors as they are."""
        if group == PASSTHROUGH:
            return dict(self.store.passthrough)
        out = {}
        for n in self._groups[group]:
            buf, spec, offset = self._param(n)
            with self.store.staged(buf.name):
                w = buf.read_master(offset, offset + spec.numel).view(spec.shape)
                out[n] = w.clone() if self.store.on_nvme(buf.name) and not buf.split else w
        return out

    def _param(self, name: str):
        buf, local = self._where[name]
        spec, offset = buf.layout.find(local)
        return buf, spec, offset

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        if group == PASSTHROUGH:
            return {}
        out = {}
        for n in self._groups[group]:
            buf, local = self._where[n]
            if buf.grad is None:
                continue
            with self.store.staged_grad(buf.name):
                g = buf.layout.views(buf.grad)[local]
                out[n] = g.clone() if self.store.on_nvme(buf.name) else g
        return out

    def _block_size(self, buf: UnitBuffers) -> int | None:
        """The unit's 8-bit block size, or None when its moments are fp32."""
        if not buf.state or UNIT_KEYS[0] not in buf.state:
            return None
        opt = self.optimizers.get(buf.name)
        if opt is None:
            raise ValueError(f"unit {buf.name} keeps 8-bit moments: pass the engine's optimizers "
                             "(HostStoreStateProvider(store, engine.optimizers))")
        return opt.block_size

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if group == PASSTHROUGH:
            return out
        for n in self._groups[group]:
            buf, local = self._where[n]
            with self.store.staged(buf.name):
                part = self._unit_state(buf, n, local)
            if self.store.on_nvme(buf.name):
                part = {k: t.clone() for k, t in part.items()}
            out.update(part)
        return out

    def _unit_state(self, buf: UnitBuffers, n: str, local: str) -> dict[str, torch.Tensor]:
        """Parameter ``n``'s optimizer state (views into ``buf.state``)."""
        st = buf.state
        if not st or float(st["step"]) == 0:
            return {}  # no step taken yet: like torch.optim, there is no state to save
        block_size = self._block_size(buf)
        if block_size is None:
            out = {f"{k}/{n}": buf.layout.views(st[k])[local] for k in MOMENTS}
        else:
            out = {kind + n: t for kind, t in unit_part(st, *self._span[n], block_size).items()}
        out[f"step/{n}"] = st["step"].reshape(())
        return out

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        names = self._groups.get(group)
        if names is None:
            raise ValueError(f"checkpoint group {group!r} does not exist in this model")
        kinds = ("param/", *(k + "/" for k in MOMENTS), "step/", *Q8_KINDS)
        extra = {k for k in tensors if not any(k == kind + n for n in names for kind in kinds)}
        if extra:
            raise ValueError(f"checkpoint group {group!r} has unexpected tensors {sorted(extra)[:3]}")
        for n in names:
            if f"param/{n}" not in tensors:
                raise ValueError(f"checkpoint group {group!r} has no weights for {n!r}")
        if group == PASSTHROUGH:
            for n in names:
                self.store.passthrough[n].copy_(tensors[f"param/{n}"])
            return
        for buf in self._units(group).values():
            with self.store.staged(buf.name, write=True):
                self._load_unit(buf, [n for n in names if self._where[n][0] is buf], tensors)

    def _load_unit(self, buf: UnitBuffers, mine: list[str], tensors: dict[str, torch.Tensor]) -> None:
        for n in mine:
            _, spec, offset = self._param(n)
            w = tensors[f"param/{n}"]
            if tuple(w.shape) != tuple(spec.shape):
                raise ValueError(f"{n}: checkpoint shape {tuple(w.shape)} != model shape "
                                 f"{tuple(spec.shape)}; saved from a different configuration")
            buf.write_master(w, offset)  # the copy source with it (split, or refreshed)
        if buf.state:
            if not self._load_8bit_exact(buf, mine, tensors):
                self._load_converted(buf, mine, fp32_moments(tensors))

    def _load_8bit_exact(self, buf: UnitBuffers, names: list[str],
                         tensors: dict[str, torch.Tensor]) -> bool:
        """Copy 8-bit moments stored as this unit keeps them, bit for bit; False (nothing
        written) when the unit is fp32 or any parameter's version is not in that form."""
        block_size = self._block_size(buf)
        if block_size is None:
            return False
        where = {n: self._span[n] for n in names}
        if not all(fits_unit(tensors, n, *where[n], block_size) for n in names):
            return False
        owned = torch.zeros(buf.layout.numel, dtype=torch.bool)
        for off, numel in where.values():
            owned[off:off + numel] = True
        for n in names:
            write_unit_part(buf.state, tensors, n, *where[n], block_size, owned)
            buf.state["step"].copy_(tensors[f"step/{n}"].reshape(()))
        return True

    def _load_converted(self, buf: UnitBuffers, names: list[str],
                        tensors: dict[str, torch.Tensor]) -> None:
        """fp32 moments (or none: saved before any step) through the unit's fp32 form."""
        opt = self.optimizers.get(buf.name)
        to_fp32 = getattr(opt, "to_fp32_state", None)
        state = to_fp32(buf.state) if to_fp32 is not None else buf.state
        fp32 = {k: v.clone() for k, v in state.items()}
        for n in names:
            local = self._where[n][1]
            if f"step/{n}" in tensors:
                for k in MOMENTS:
                    buf.layout.views(fp32[k])[local].copy_(tensors[f"{k}/{n}"])
                fp32["step"].copy_(tensors[f"step/{n}"].reshape(()))
            else:  # saved before any step: fresh moments
                for k in MOMENTS:
                    buf.layout.views(fp32[k])[local].zero_()
                fp32["step"].zero_()
        back = getattr(opt, "from_fp32_state", None)
        new_state = back(fp32) if back is not None else fp32
        for k, v in new_state.items():
            buf.state[k].copy_(v)

    def model_config(self) -> dict | None:
        return self.store.adapter.model_config.to_dict()
