"""A decoder model with LoRA adapters on a frozen base, as the engine sees it: each layer's
template swaps ``nn.Linear`` for ``StreamedLinear``, so the engine binds one flat buffer per layer
as for a full model. Adapter names are PEFT's without ``base_model.model.``, one to one."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection

import torch
from torch import nn

from ..models.adapter import DecoderAdapter, LayerContext, ParamSpec, Unit
from ..plan.finetune import FrozenBase
from ..plan.shape import ModelShape
from .config import ALL_LINEAR, LoraConfig
from .layout import LoraLayout
from .linear import StreamedLinear, dropout_scope
from .quant import is_packed, packed_nbytes

DROPOUT_SEED_KEY = "lora_dropout_seed"
"""Key of a training micro-batch's dropout seed in its ``LayerContext.masks`` (a CPU int64
tensor: the context lives as long as the micro-batch, through its forward, recompute and
backward)."""

BASE_HELD = {"bf16": torch.bfloat16}


def matches_target(name: str, targets: list[str]) -> bool:
    """PEFT's rule for a list of names: the module's name is one, or ends with ``.`` + one."""
    return ALL_LINEAR in targets or any(name == t or name.endswith("." + t) for t in targets)


class LoraAdapter:
    """``DecoderAdapter``'s interface for a LoRA (QLoRA) run; see the module docstring."""

    def __init__(self, base: DecoderAdapter, lora: LoraConfig,
                 compute_dtype: torch.dtype = torch.float32, seed: int = 0,
                 packed_names: Collection[str] | None = None):
        """``packed_names``: hold only these base tensors in the base format (a quantized
        release's own packed ones, the rest as its plain weights are); None: every matmul weight."""
        lora.check()
        if not lora.enabled:
            raise ValueError("lora.r is 0: there are no adapters to train; use the plain adapter")
        bad = [t for t in lora.target_modules if "layers." in t or t == "lm_head"]
        if bad:
            raise ValueError(f"lora.target_modules {bad}: name linears inside a decoder layer "
                             "(the same in every layer: q_proj, v_proj, mlp.down_proj, ...) or "
                             f"{ALL_LINEAR}; the embedding and lm_head stay frozen")
        self.base = base
        self.lora = lora
        self.compute_dtype = compute_dtype
        self.seed = seed
        self.training = True
        """Dropout is drawn only while training (``eval()`` around evaluation, as in PyTorch)."""
        self.dropout_draws = 0
        """Training micro-batches started so far: the dropout seed of the next is derived from it
        (a resumed run sets it back, so its masks are the uninterrupted run's)."""
        self.base_format = lora.base_dtype if is_packed(lora.base_dtype) else "float"
        self.packed_names = None if packed_names is None else frozenset(packed_names)
        self.float_dtype = BASE_HELD.get(lora.base_dtype, compute_dtype)
        """The dtype of a matmul weight the base format does not pack."""
        swapped: dict[int, nn.Module] = {}
        self._templates: list[nn.Module] = []
        for i in range(base.num_layers):
            original = base.layer_template(i)
            if id(original) not in swapped:
                swapped[id(original)] = self._swap_linears(original, base.layout.layer_prefix(i))
            self._templates.append(swapped[id(original)])
        self.target_names = sorted({n for t in swapped.values() for n, m in t.named_modules()
                                    if isinstance(m, StreamedLinear) and m.r})
        if not self.target_names:
            raise ValueError(f"lora.target_modules {lora.target_modules} match no linear of the "
                             f"decoder layers; they have "
                             f"{sorted(n for n, m in original.named_modules() if isinstance(m, nn.Linear))}")
        units, self.layouts = [], {}
        for unit in base.units:
            trainable, frozen = self._unit_tensors(unit)
            units.append(Unit(unit.name, unit.kind, unit.index, trainable))
            self.layouts[unit.name] = LoraLayout.build(trainable, frozen, compute_dtype.itemsize)
        self.units: tuple[Unit, ...] = tuple(units)

    def __getattr__(self, name: str):
        # everything else (config, sizes, embed, head_logits, rotary, ...) is the base model's
        return getattr(self.__dict__["base"], name)

    # ----- structure ---------------------------------------------------------------------

    def _format(self, hf_name: str) -> str:
        """The format base matmul weight ``hf_name`` is held in."""
        packed = self.packed_names is None or hf_name in self.packed_names
        return self.base_format if packed else "float"

    def _swap_linears(self, layer: nn.Module, prefix: str) -> nn.Module:
        """``layer`` with its linears swapped, in the formats of the layer named ``prefix``'s."""
        out = copy.deepcopy(layer)
        # a Linear subclass with a forward of its own (PhiMoE's and Llama 4's routers return a
        # tuple) keeps it: held in the compute dtype, never an adapter's base
        linears = [(n, m) for n, m in out.named_modules()
                   if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward]
        for module_id, (name, lin) in enumerate(linears):
            shape = (lin.out_features, lin.in_features)
            fmt = self._format(f"{prefix}{name}.weight")
            meta = (torch.empty(packed_nbytes(fmt, shape), dtype=torch.uint8, device="meta")
                    if is_packed(fmt) else torch.empty(shape, dtype=self.float_dtype, device="meta"))
            r = self.lora.r if matches_target(name, self.lora.target_modules) else 0
            new = StreamedLinear(lin.in_features, lin.out_features, lin.bias is not None,
                                 fmt, meta, r, self.lora.scaling, self.lora.dropout, module_id)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, new)
        return out

    def _unit_tensors(self, unit: Unit):
        """(trainable specs, frozen (spec, format, held dtype, bytes, bind dtype)) of one base unit.
        The base format holds the layer's matmul weights: its linears' (a ``StreamedLinear``
        dequantises its own) and its expert tensors (3-D; dequantised as the layer is bound)."""
        if unit.kind != "layer":
            return (), [(p, "float", self.compute_dtype, p.numel * self.compute_dtype.itemsize, None)
                        for p in unit.params]
        template = self._templates[unit.index]
        prefix = self.base.layout.layer_prefix(unit.index)
        trainable = tuple(ParamSpec(n, prefix + n, tuple(p.shape))
                          for n, p in template.named_parameters() if ".lora_" in n)
        linear_fmt = {n + ".weight": m.fmt for n, m in template.named_modules()
                      if isinstance(m, StreamedLinear)}
        frozen = []
        for p in unit.params:
            experts = len(p.shape) == 3
            fmt = linear_fmt.get(p.local) or (self._format(p.hf_name) if experts else None)
            if fmt is None:  # norms, biases, routers: the compute dtype
                frozen.append((p, "float", self.compute_dtype, p.numel * self.compute_dtype.itemsize, None))
            elif is_packed(fmt):
                frozen.append((p, fmt, torch.uint8, packed_nbytes(fmt, p.shape),
                               self.compute_dtype if experts else None))
            else:
                frozen.append((p, "float", self.float_dtype, p.numel * self.float_dtype.itemsize, None))
        return trainable, frozen

    @property
    def layer_units(self) -> tuple[Unit, ...]:
        return self.units[1:-1]

    def num_params(self) -> int:
        """Trainable parameters (the adapters)."""
        return sum(u.numel for u in self.units)

    def num_base_params(self) -> int:
        return self.base.num_params()

    def plan_shape(self) -> ModelShape:
        """The planner's shape of this run (``ModelShape.frozen_base`` from the real layouts)."""
        shape = ModelShape.from_config(self.base.config, adapter=self.base)
        layer = self.layouts[self.units[1].name]
        matmul = [e for e in layer.frozen if len(e.shape) >= 2]
        per = sum(e.nbytes for e in matmul) / sum(e.numel for e in matmul)
        adapter = layer.numel
        return dataclasses.replace(shape, frozen_base=FrozenBase(
            adapter, None if self.lora.base_dtype == "compute" else per, 2.0 * adapter))

    # ----- modes ----------------------------------------------------------------------------

    def train(self, mode: bool = True) -> LoraAdapter:
        self.training = mode
        return self

    def eval(self) -> LoraAdapter:
        return self.train(False)

    # ----- computation ------------------------------------------------------------------------

    def layer_context(self, shape: tuple[int, int], device, dtype: torch.dtype, rotary: nn.Module,
                      segment_ids: torch.Tensor | None = None, router: bool = False) -> LayerContext:
        """The base's context; while training with dropout, plus this micro-batch's dropout seed
        (called once per micro-batch, in program order on the compute lane)."""
        ctx = self.base.layer_context(shape, device, dtype, rotary, segment_ids, router)
        if self.training and self.lora.dropout:
            ctx.masks[DROPOUT_SEED_KEY] = torch.tensor(self.seed * 1_000_033 + self.dropout_draws)
            self.dropout_draws += 1
        return ctx

    def layer(self, index: int, params: dict[str, torch.Tensor], hidden: torch.Tensor,
              ctx: LayerContext) -> torch.Tensor:
        seed = ctx.masks.get(DROPOUT_SEED_KEY)
        with dropout_scope(None if seed is None else int(seed), index):
            return self.base.layer(index, params, hidden, ctx, module=self._templates[index])

    def template(self, index: int) -> nn.Module:
        """Layer ``index``'s template (meta device), e.g. to read a ``StreamedLinear``'s format."""
        return self._templates[index]
