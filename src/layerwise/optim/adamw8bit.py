"""Hybrid 8-bit AdamW: block-wise 8-bit moments where memory is short, fp32 elsewhere.

``AdamW8bit`` is a drop-in ``torch.optim.Optimizer``; ``HostAdamW8bit`` the engine's per-unit
optimizer. ``step`` stays a 0-d tensor for checkpoints, but the count is read from a host-side
int (``HostSteps``): on CUDA every ``.item()`` would sync. ``state_to_fp32``/``state_to_8bit``
convert, so checkpoints of either optimizer load into the other."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from ..store import UnitBuffers
from . import quant
from ._kernel import FlatStep, StepScalars, fused_step, fused_steps
from .adamw import AdamWConfig
from .clip import clip_or_skip

Q8_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
"""State entries of an 8-bit moment pair (besides ``step``)."""
FP32_KEYS = ("exp_avg", "exp_avg_sq")
MOMENT_FORMATS = ("8bit", "fp32")


# ----- state conversion ---------------------------------------------------------------------

def zeros_8bit(numel: int, block_size: int, device: torch.device | str = "cpu",
               zeros: Callable[[int, torch.dtype], torch.Tensor] | None = None
               ) -> dict[str, torch.Tensor]:
    """``zeros(numel, dtype)``: where the host tensors come from (a store's allocator)."""
    nb = quant.num_blocks(numel, block_size)
    if zeros is None:
        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)
    return {
        "exp_avg_codes": zeros(numel, torch.int8),
        "exp_avg_scales": zeros(nb, torch.float32),
        "exp_avg_sq_codes": zeros(numel, torch.uint8),
        "exp_avg_sq_scales": zeros(nb, torch.float32),
    }


def state_nbytes(numel: int, block_size: int = quant.DEFAULT_BLOCK_SIZE) -> int:
    """Host bytes of 8-bit state for ``numel`` parameters: two 1-byte codes per element, two fp32
    scales per block, and the fp32 step."""
    return 2 * numel + 8 * quant.num_blocks(numel, block_size) + 4


class HostSteps:
    """Step counts as Python ints, one per ``step`` tensor, so an update never reads a tensor.

    The int is trusted while the tensor's version counter is unchanged; after an outside write (a
    checkpoint load) the tensor is read once. Keyed by ``id`` with a weak reference that must still
    match, so a recycled id never does. Thread-safe across tensors."""

    def __init__(self) -> None:
        self._counts: dict[int, tuple[weakref.ref, int, int]] = {}
        self._lock = threading.Lock()

    def seed(self, step: torch.Tensor, count: int) -> None:
        """``step`` holds ``count`` (it was just created with that value)."""
        with self._lock:
            self._put(step, count)

    def _put(self, step: torch.Tensor, count: int) -> None:
        key = id(step)
        old = self._counts.get(key)
        if old is not None and old[0]() is step:
            ref = old[0]
        else:
            counts = self._counts

            def forget(r: weakref.ref, key: int = key) -> None:  # no lock: runs inside GC
                entry = counts.get(key)
                if entry is not None and entry[0] is r:
                    counts.pop(key, None)

            ref = weakref.ref(step, forget)
        self._counts[key] = (ref, step._version, count)

    def advance(self, step: torch.Tensor) -> int:
        return self.advance_many([step])[0]

    def advance_many(self, steps: list[torch.Tensor]) -> list[int]:
        """``advance`` for many tensors: one lock round and one ``_foreach_add_``."""
        counts = []
        with self._lock:
            for s in steps:
                e = self._counts.get(id(s))
                if e is not None and e[0]() is s and e[1] == s._version:
                    counts.append(e[2] + 1)
                else:
                    counts.append(int(s.item()) + 1)  # once, after an outside write
            torch._foreach_add_(steps, 1)
            for s, c in zip(steps, counts):
                self._put(s, c)
        return counts


def is_8bit_state(state: dict[str, Any]) -> bool:
    return "exp_avg_codes" in state


def _check_block_size(state: dict[str, Any], block_size: int) -> None:
    n, nb = state["exp_avg_codes"].numel(), state["exp_avg_scales"].numel()
    if nb != quant.num_blocks(n, block_size):
        raise ValueError(
            f"8-bit state has {nb} block scales for {n} elements, which does not fit "
            f"block_size={block_size}; pass the block size the state was written with"
        )


def state_to_fp32(state: dict[str, Any], block_size: int = quant.DEFAULT_BLOCK_SIZE,
                  shape: torch.Size | None = None) -> dict[str, Any]:
    """``torch.optim.AdamW``-style state (``step``, ``exp_avg``, ``exp_avg_sq``) from 8-bit state.

    fp32 state is returned as is (a shallow copy); other entries are kept."""
    if not is_8bit_state(state):
        return dict(state)
    _check_block_size(state, block_size)
    out = {k: v for k, v in state.items() if k not in Q8_KEYS}
    m = quant.dequantize_signed(state["exp_avg_codes"], state["exp_avg_scales"], block_size)
    v = quant.dequantize_sq(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], block_size)
    if shape is not None:
        m, v = m.view(shape), v.view(shape)
    out["exp_avg"], out["exp_avg_sq"] = m, v
    return out


def state_to_8bit(state: dict[str, Any], block_size: int = quant.DEFAULT_BLOCK_SIZE
                  ) -> dict[str, Any]:
    """8-bit state from ``torch.optim.AdamW``-style state; 8-bit state is returned as is."""
    if is_8bit_state(state):
        _check_block_size(state, block_size)
        return dict(state)
    out = {k: v for k, v in state.items() if k not in FP32_KEYS}
    m = state["exp_avg"].detach().reshape(-1).float()
    v = state["exp_avg_sq"].detach().reshape(-1).float()
    out["exp_avg_codes"], out["exp_avg_scales"] = quant.quantize_signed(m, block_size)
    out["exp_avg_sq_codes"], out["exp_avg_sq_scales"] = quant.quantize_sq(v, block_size)
    return out


# ----- the per-unit face --------------------------------------------------------------------

class HostAdamW8bit:
    """8-bit moments for one unit's flat buffer; ``step_unit`` touches only ``buf``'s tensors, so
    units may step on different threads (the kernel releases the GIL)."""

    def __init__(self, config: AdamWConfig, block_size: int = quant.DEFAULT_BLOCK_SIZE,
                 num_threads: int | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.num_threads = num_threads
        """Threads one ``step_unit`` call splits its blocks over; None: torch's thread count."""
        self.steps = HostSteps()

    def init_state(self, buf: UnitBuffers) -> None:
        # pageable: only the copy sources are pinned (see layerwise.store)
        state = zeros_8bit(buf.layout.numel, self.block_size, zeros=buf.alloc.zeros)
        state["step"] = buf.alloc.zeros(1, torch.float32).view(())
        self.steps.seed(state["step"], 0)
        buf.state = state

    def state_nbytes(self, numel: int) -> int:
        """Bytes ``init_state`` allocates for a unit of ``numel`` parameters."""
        return state_nbytes(numel, self.block_size)

    def step_unit(self, buf: UnitBuffers, lr: float, clip_coef: float) -> None:
        if not math.isfinite(clip_coef):
            raise ValueError(
                f"clip coefficient {clip_coef} is not finite; skip the step when the global "
                "gradient norm is not finite (see clip.clip_or_skip)"
            )
        c, s = self.config, buf.state
        k = StepScalars.of(lr, c.betas[0], c.betas[1], c.eps, c.weight_decay,
                           self.steps.advance(s["step"]), grad_mul=clip_coef)
        # a split master is stepped as its two halves (bit-identical to the fp32 master); a
        # bf16 gradient (one micro-batch per step) is widened inside the kernel, exactly
        p = buf.compute if buf.split else buf.master
        fused_step(p, buf.grad, s["exp_avg_codes"], s["exp_avg_scales"], s["exp_avg_sq_codes"],
                   s["exp_avg_sq_scales"], self.block_size, buf.layout.decay_numel, k,
                   self.num_threads, p_lo=buf.remainder)

    def to_fp32_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unit's state as ``HostAdamW`` keeps it (flat fp32 ``exp_avg``, ``exp_avg_sq``)."""
        return state_to_fp32(state, self.block_size)

    def from_fp32_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``HostAdamW``-style unit state → this optimizer's 8-bit state."""
        return state_to_8bit(state, self.block_size)



# ----- the torch.optim face -----------------------------------------------------------------

class AdamW8bit(torch.optim.Optimizer):
    """AdamW with block-wise 8-bit moments, hybrid per group, optional fused global-norm clip; equal
    to ``torch.optim.AdamW`` up to quantisation. After each ``step``: ``last_grad_norm``,
    ``last_step_skipped``, ``skipped_steps``."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, moments: str = "8bit",
                 block_size: int = quant.DEFAULT_BLOCK_SIZE, min_8bit_numel: int = 4096,
                 max_grad_norm: float | None = None, num_threads: int | None = None):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, "
                             f"{weight_decay}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if max_grad_norm is not None and max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        moments=moments, block_size=block_size, min_8bit_numel=min_8bit_numel)
        super().__init__(params, defaults)
        for g in self.param_groups:
            self._check_group(g)
        self.max_grad_norm = max_grad_norm
        """Global L2 clip over all groups; None or 0 disables clipping."""
        self.num_threads = num_threads
        self.steps = HostSteps()
        """The step counts of 8-bit state, on the host (their tensors live on the CPU)."""
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False

    @staticmethod
    def _check_group(g: dict[str, Any]) -> None:
        if g["moments"] not in MOMENT_FORMATS:
            raise ValueError(f"moments must be one of {MOMENT_FORMATS}, got {g['moments']!r}")
        if g["block_size"] <= 0:
            raise ValueError(f"block_size must be positive, got {g['block_size']}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    @staticmethod
    def _uses_8bit(group: dict[str, Any], p: torch.Tensor) -> bool:
        return group["moments"] == "8bit" and p.numel() >= group["min_8bit_numel"]

    def _init_state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            if self._uses_8bit(group, p):
                state["step"] = torch.zeros((), dtype=torch.float32)  # host: read, never synced
                self.steps.seed(state["step"], 0)
                state.update(zeros_8bit(p.numel(), group["block_size"], p.device))
            else:  # the fused fp32 kernel reads the step on the parameter's device
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (fp32 accumulation, one pass), as clip_grad_norm_."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad)
        if not by_device:
            return 0.0
        partial = []
        for grads in by_device.values():
            norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in grads] \
                if any(t.dtype != torch.float32 for t in grads) else torch._foreach_norm(grads)
            partial.append(torch.linalg.vector_norm(torch.stack(norms)).cpu())
        return float(torch.linalg.vector_norm(torch.stack(partial)))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coef = 1.0
        self.last_step_skipped = False
        if self.max_grad_norm:
            total = self.grad_norm()
            self.last_grad_norm = total
            coef = clip_or_skip(total, self.max_grad_norm)
            if coef is None:
                self.skipped_steps += 1
                self.last_step_skipped = True
                return loss
        # every 8-bit tensor of every group in one kernel call (per worker thread): the
        # per-tensor cost is a row of a table, not a launch; fp32 tensors: one fused torch
        # call per group
        flat: list[FlatStep] = []
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            self._step_group(group, coef, flat, copy_back)
        if flat:
            fused_steps(flat, self.num_threads)
            for p, flat_p in copy_back:
                p.copy_(flat_p.view_as(p))
        return loss

    def _step_group(self, group: dict[str, Any], coef: float, flat: list[FlatStep],
                    copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run ``group``'s fp32 tensors; append its 8-bit tensors' updates to ``flat``."""
        beta1, beta2 = group["betas"]
        fp32 = ([], [], [], [], [])
        eight = []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise ValueError("AdamW8bit does not support sparse gradients; use dense ones")
            state = self._init_state(group, p)
            if "exp_avg_codes" in state:
                eight.append((p, grad, state))
                continue
            for lst, t in zip(fp32, (p, grad, state["exp_avg"], state["exp_avg_sq"],
                                     state["step"])):
                lst.append(t)
        if eight:
            counts = self.steps.advance_many([st["step"] for _, _, st in eight])
            scalars: dict[int, StepScalars] = {}
            block = group["block_size"]
            for (p, grad, st), count in zip(eight, counts):
                k = scalars.get(count)
                if k is None:
                    k = scalars[count] = StepScalars.of(
                        group["lr"], beta1, beta2, group["eps"], group["weight_decay"], count,
                        grad_mul=coef)
                if not p.is_contiguous():  # the kernel updates a flat copy, copied back after
                    flat_p = p.detach().reshape(-1).clone()
                    copy_back.append((p, flat_p))
                    p = flat_p
                flat.append(FlatStep(p, grad, st["exp_avg_codes"], st["exp_avg_scales"],
                                     st["exp_avg_sq_codes"], st["exp_avg_sq_scales"], block,
                                     p.numel(), k))
        if fp32[0]:
            params, grads, exp_avgs, exp_avg_sqs, steps = fp32
            fused = all(t.dtype in (torch.float32, torch.float16, torch.bfloat16)
                        and t.device.type in ("cpu", "cuda") for t in params)
            scale = None
            if coef != 1.0:
                if fused:
                    scale = torch.tensor(1.0 / coef, device=params[0].device)
                else:
                    torch._foreach_mul_(grads, coef)
            _torch_adamw(
                params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=fused or None,
                grad_scale=scale, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    # ----- state dicts ----------------------------------------------------------------------

    def torch_adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state in ``torch.optim.AdamW``'s format (fp32 moments), loadable by
        either."""
        sd = self.state_dict()
        defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
        groups = []
        for g, live in zip(sd["param_groups"], self.param_groups):
            ng = {k: v for k, v in g.items() if k not in ("moments", "block_size",
                                                          "min_8bit_numel")}
            for k, v in defaults.items():
                ng.setdefault(k, v)
            groups.append(ng)
        state = {}
        params = [p for g in self.param_groups for p in g["params"]]
        block_of = {id(p): g["block_size"] for g in self.param_groups for p in g["params"]}
        for idx, s in sd["state"].items():
            p = params[idx]
            s = state_to_fp32(s, block_of[id(p)], p.shape)
            s["exp_avg"] = s["exp_avg"].to(p.device, p.dtype).view(p.shape)
            s["exp_avg_sq"] = s["exp_avg_sq"].to(p.device, p.dtype).view(p.shape)
            s["step"] = s["step"].detach().to("cpu", torch.float32)
            state[idx] = s
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict exactly, or a ``torch.optim.AdamW`` one (quantised as needed).

        Groups keep their moment format / block size when the saved dict does not name them."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}; build it over the same groups")
        groups = []
        for sg, live in zip(saved_groups, self.param_groups):
            ng = dict(sg)
            for key in ("moments", "block_size", "min_8bit_numel"):
                ng.setdefault(key, live[key])
            self._check_group(ng)
            groups.append(ng)
        params = {i: (p, ng) for sg, ng, live in zip(saved_groups, groups, self.param_groups)
                  for i, p in zip(sg["params"], live["params"])}
        state, exact = {}, {}
        for idx, s in state_dict["state"].items():
            p, g = params[idx]
            old_block = _saved_block(saved_groups, idx) or g["block_size"]
            if self._uses_8bit(g, p):
                if is_8bit_state(s) and old_block != g["block_size"]:
                    s = state_to_fp32(s, old_block)
                s = state_to_8bit(s, g["block_size"])
            else:
                s = state_to_fp32(s, old_block, p.shape)
            # own copies: the caller's dict (e.g. another optimizer's live state) stays unshared
            state[idx] = {k: v.detach().clone() if torch.is_tensor(v) else v
                          for k, v in s.items()}
            if self._uses_8bit(g, p):
                exact[idx] = {k: state[idx][k] for k in Q8_KEYS}
        super().load_state_dict({"state": state, "param_groups": groups})
        for idx, (p, _) in params.items():
            if p not in self.state:
                continue
            st = self.state[p]
            for k, v in exact.get(idx, {}).items():  # the base class cast them to p's dtype
                st[k] = v.to(p.device)
            # 8-bit: on the host, where the update reads it; fp32: where the fused kernel does
            where = "cpu" if is_8bit_state(st) else p.device
            st["step"] = st["step"].to(device=where, dtype=torch.float32)


def _saved_block(saved_groups: list[dict[str, Any]], idx: int) -> int | None:
    for g in saved_groups:
        if idx in g["params"]:
            return g.get("block_size")
    return None
