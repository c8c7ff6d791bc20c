"""Where checkpoint groups come from and go back to: the ``StateProvider`` protocol.

The checkpointer never touches a model or optimizer directly, so the engine's host store plugs
in with its own provider. An optional ``register_update_hook(fn)`` (fn runs before the weights
or state are written; returns a handle or None) enables deferred snapshots. Blob keys are the
contract with merge/export: ``docs/formats.md``."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from ..models.names import groups_of_model, model_is_tied
from ..util.jsonable import jsonable
from .moments import CODES_M, Q8_BLOCKS, Q8_KINDS, UNIT_KEYS, dequantize, geometry

# Blob keys of one group's tensors: ``<kind><hf_name>``.
PARAM, EXP_AVG, EXP_AVG_SQ, STEP = "param/", "exp_avg/", "exp_avg_sq/", "step/"
OPTIM_KINDS = (EXP_AVG, EXP_AVG_SQ, STEP)


@runtime_checkable
class StateProvider(Protocol):
    """The live training state, seen group by group."""

    def group_names(self) -> dict[str, list[str]]:
        """Group -> HF parameter names, in model order (stable for the provider's lifetime)."""
        ...

    def params(self, group: str) -> dict[str, torch.Tensor]:
        """Live weights of ``group`` by HF name (views, not copies)."""
        ...

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        """Live gradients of ``group`` by HF name; names without a gradient are left out."""
        ...

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        """Live optimizer state of ``group`` in blob keys (``exp_avg/<name>``, ``step/<name>``…).

        Tensors may be in any dtype/device; the checkpointer snapshots them to fp32 on the host."""
        ...

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a stored group version (blob keys) into the live state, in place."""
        ...

    def model_config(self) -> dict | None:
        """The model's HF ``config.json`` contents, if it has one."""
        ...


def group_tensors(provider: StateProvider, group: str) -> dict[str, torch.Tensor]:
    """Everything of one group in blob keys (live tensors, not copies)."""
    out = {PARAM + n: t for n, t in provider.params(group).items()}
    out.update(provider.optimizer_state(group))
    return out


class ModuleStateProvider:
    """An ``nn.Module`` and its ``torch.optim`` optimizer; a parameter not stepped yet has no state
    stored, and loading creates the state entries."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.optimizer = optimizer
        self.tied = model_is_tied(model)
        self._groups = groups_of_model(model)
        self._param = dict(model.named_parameters())
        self._block_size: dict[str, int | None] = {}
        """Per parameter: its optimizer group's 8-bit block size (``AdamW8bit``), else None."""
        if optimizer is not None:
            known = {id(p) for p in self._param.values()}
            for pg in optimizer.param_groups:
                for p in pg["params"]:
                    if id(p) not in known:
                        raise ValueError(
                            "the optimizer holds a parameter that is not in the model; build the "
                            "optimizer from model.parameters() (or pass the matching model)"
                        )
            name_of = {id(p): n for n, p in self._param.items()}
            self._block_size = {name_of[id(p)]: pg.get("block_size")
                                for pg in optimizer.param_groups for p in pg["params"]}

    def group_names(self) -> dict[str, list[str]]:
        return self._groups

    def params(self, group: str) -> dict[str, torch.Tensor]:
        return {n: self._param[n].detach() for n in self._groups[group]}

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        return {n: g.detach() for n in self._groups[group] if (g := self._param[n].grad) is not None}

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self.optimizer is None:
            return out
        for n in self._groups[group]:
            st = self.optimizer.state.get(self._param[n])
            if not st:
                continue
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"{k}/{n}"] = v.detach()
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{k}/{n}"] = torch.tensor(float(v), dtype=torch.float32)
            if CODES_M + n in out:  # AdamW8bit: blocks start at the tensor's first element
                out[Q8_BLOCKS + n] = torch.tensor([self._block_size[n], 0], dtype=torch.int64)
        return out

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        names = self._groups.get(group)
        if names is None:
            raise ValueError(f"checkpoint group {group!r} does not exist in this model")
        by_name: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            kind, _, name = key.partition("/")
            by_name.setdefault(name, {})[kind] = t
        for n in names:
            got = by_name.get(n, {})
            p = self._param[n]
            if Q8_BLOCKS[:-1] in got:
                got = self._moments_for(n, got)
            if "param" not in got:
                raise ValueError(f"checkpoint group {group!r} has no weights for {n!r}")
            w = got.pop("param")
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(
                    f"{n}: checkpoint shape {tuple(w.shape)} != model shape {tuple(p.shape)}; "
                    "the checkpoint was saved from a different model configuration"
                )
            with torch.no_grad():
                p.copy_(w)
            if self.optimizer is None:
                continue
            if not got:
                self.optimizer.state.pop(p, None)
                continue
            st = self.optimizer.state[p]  # defaultdict: creates the entry
            for k in (*UNIT_KEYS, "exp_avg", "exp_avg_sq"):
                if k not in got:  # moments of the other form (8-bit / fp32) the live state had
                    st.pop(k, None)
            for k, v in got.items():
                old = st.get(k)
                if k in UNIT_KEYS:  # 8-bit codes and scales keep their own dtypes
                    st[k] = v.to(device=p.device)
                elif isinstance(old, torch.Tensor):
                    st[k] = v.to(device=old.device, dtype=old.dtype)
                elif k == "step":
                    # torch.optim keeps ``step`` as a 0-d fp32 CPU tensor (non-capturable).
                    st[k] = v.to(torch.float32).reshape(())
                elif isinstance(old, (int, float)):
                    st[k] = type(old)(v.item())
                else:
                    dtype = p.dtype if v.is_floating_point() else v.dtype
                    st[k] = v.to(device=p.device, dtype=dtype)
        extra = set(by_name) - set(names)
        if extra:
            raise ValueError(f"checkpoint group {group!r} has tensors for unknown parameters {sorted(extra)}")

    def _moments_for(self, name: str, got: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A parameter's stored 8-bit moments as its optimizer keeps them: as they are when its
        param group quantises in blocks of the same size (``AdamW8bit``), else as fp32
        ``exp_avg`` / ``exp_avg_sq``."""
        q8 = {kind + name: got.pop(kind[:-1]) for kind in Q8_KINDS}
        if geometry(q8, name) == (self._block_size.get(name), 0):
            return {**got, **{kind[:-1]: q8[kind + name] for kind in Q8_KINDS[:-1]}}
        m, v = dequantize(q8, name)
        shape = self._param[name].shape
        return {**got, "exp_avg": m.view(shape), "exp_avg_sq": v.view(shape)}

    def model_config(self) -> dict | None:
        config = getattr(self.model, "config", None)
        to_dict = getattr(config, "to_dict", None)
        return to_dict() if callable(to_dict) else None

    def register_update_hook(self, fn: Callable[[], None]) -> Any:
        """Call ``fn`` before every ``optimizer.step()`` (a torch step pre-hook), which is what
        changes the weights and optimizer state in a training loop; its handle, or None without
        a torch optimizer."""
        register = getattr(self.optimizer, "register_step_pre_hook", None)
        if register is None:
            return None
        return register(lambda _opt, _args, _kwargs: fn())

    # ----- non-layer optimizer state (hyper-parameters per param group) ------------------

    def param_groups_state(self) -> list[dict] | None:
        if self.optimizer is None:
            return None
        return [{k: jsonable(v) for k, v in pg.items() if k != "params"}
                for pg in self.optimizer.param_groups]

    def load_param_groups_state(self, saved: list[dict] | None) -> None:
        if self.optimizer is None or not saved:
            return
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved)} optimizer param groups, the optimizer has "
                f"{len(self.optimizer.param_groups)}; build the optimizer the same way as when saving"
            )
        for pg, s in zip(self.optimizer.param_groups, saved):
            for k, v in s.items():
                old = pg.get(k)
                if isinstance(old, torch.Tensor) and old.numel() == 1:
                    old.fill_(float(v))
                elif isinstance(old, tuple):
                    pg[k] = tuple(v)
                else:
                    pg[k] = v


class DictStateProvider:
    """Plain dicts of tensors per group (blob keys): tests, benchmarks, foreign states."""

    def __init__(self, groups: dict[str, dict[str, torch.Tensor]], config: dict | None = None):
        self.state = groups
        self.config = config

    def group_names(self) -> dict[str, list[str]]:
        return {g: [k[len(PARAM):] for k in ts if k.startswith(PARAM)] for g, ts in self.state.items()}

    def params(self, group: str) -> dict[str, torch.Tensor]:
        return {k[len(PARAM):]: t for k, t in self.state[group].items() if k.startswith(PARAM)}

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        return {}

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        return {k: t for k, t in self.state[group].items() if not k.startswith(PARAM)}

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        cur = self.state.setdefault(group, {})
        for k, t in tensors.items():
            if k in cur and cur[k].shape == t.shape:
                cur[k].copy_(t)
            else:
                cur[k] = t.clone()

    def model_config(self) -> dict | None:
        return self.config


# ----- JSON-able non-layer state -------------------------------------------------------------


def capture_rng() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part: python + numpy RNG, tensor part: torch CPU/CUDA generator states)."""
    cuda = (torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return rng_parts({"python": random.getstate(), "numpy": np.random.get_state(),
                      "cpu": torch.get_rng_state(), "cuda": cuda})


def rng_dict(js: dict | None, tensors: dict[str, torch.Tensor]) -> dict | None:
    """RNG states in the shape HF Trainer's ``rng_state.pth`` uses (python/numpy/cpu/cuda)."""
    if js is None and not tensors:
        return None
    out: dict[str, Any] = {}
    if js and "python" in js:
        v, internal, gauss = js["python"]
        out["python"] = (v, tuple(internal), gauss)
    if js and "numpy" in js:
        name, keys, pos, has_gauss, cached = js["numpy"]
        out["numpy"] = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    if "torch_cpu" in tensors:
        out["cpu"] = tensors["torch_cpu"]
    cuda_keys = [k for k in tensors if k.startswith("torch_cuda_")]
    cuda = [tensors[k] for k in sorted(cuda_keys, key=lambda k: int(k.rsplit("_", 1)[1]))]
    out["cuda"] = cuda or None
    return out


def rng_parts(rng: dict | None) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """``rng_dict``'s inverse: RNG states in the Trainer's shape -> (JSON part, tensors), as a
    save stores them. (None, {}) for None."""
    if rng is None:
        return None, {}
    js: dict[str, Any] = {}
    if rng.get("python") is not None:
        version, internal, gauss = rng["python"]
        js["python"] = [version, list(internal), gauss]
    if rng.get("numpy") is not None:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        js["numpy"] = [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    tensors = {}
    if rng.get("cpu") is not None:
        tensors["torch_cpu"] = rng["cpu"]
    cuda = rng.get("cuda")
    for i, s in enumerate([cuda] if isinstance(cuda, torch.Tensor) else cuda or []):
        tensors[f"torch_cuda_{i}"] = s
    return js, tensors


def restore_rng(rng: dict) -> None:
    if rng.get("python") is not None:
        random.setstate(rng["python"])
    if rng.get("numpy") is not None:
        np.random.set_state(rng["numpy"])
    if rng.get("cpu") is not None:
        torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") and torch.cuda.is_available():
        for i, s in enumerate(rng["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
