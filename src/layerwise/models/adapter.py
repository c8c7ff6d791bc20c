"""Split a Hugging Face decoder LM into ``pre | layers[i] | post`` units, with HF key maps.

A *unit* is what layerwise stores, streams, updates and checkpoints as one piece:

- ``embed``: the token embedding (``model.embed_tokens.weight``); with tied embeddings it also
  serves as the lm_head, so a tied head has no weights of its own;
- ``layers.{i}``: decoder block ``i`` (``model.layers.{i}.*``: its parameters and the
  persistent buffers HF saves with them, which are *frozen*: never trained);
- ``head``: the final norm and, when untied, ``lm_head.weight``.

A layer runs as HF's own decoder-layer module, called as HF's model forward calls it
(``position_embeddings`` of its layer type, the mask of its attention type, ``position_ids``),
through ``torch.func.functional_call`` on a meta-device template: a pure function of the
parameters given, so the engine runs any layer on views of a flat device buffer without a
module per layer. One template serves every layer of the same structure (layer type,
parameter shapes, module classes and their plain attributes): dense and MoE layers, full,
sliding and linear attention each get their own. The head is the causal LM's own forward with
its base model replaced by the final norm (soft caps and logit scales are the family's code);
the embedding scale is read off the embedding module (or the config's
``embedding_multiplier``); masks and positions of packed rows are ``attention.py``'s, the MoE
aux loss ``moe.py``'s, the per-layer sizes and FLOPs ``structure.py``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from .attention import RowLayout, attention_masks, row_layout
from .families import LINEAR_ATTENTION, attn_implementation, family_of, layer_attention_types, layer_windows
from .moe import LayerTail, RouterRecorder, RouterSpec, RouterState
from .names import EMBED, HEAD, HF_EMBED_PREFIX, HF_LAYER_PREFIX, HF_NORM_PREFIX, layer_unit


@dataclass(frozen=True)
class ParamSpec:
    local: str
    """Name inside the unit's template module, e.g. ``self_attn.q_proj.weight``."""
    hf_name: str
    """Full Hugging Face state-dict key, e.g. ``model.layers.3.self_attn.q_proj.weight``."""
    shape: tuple[int, ...]
    trainable: bool = True
    """False for a persistent buffer (saved with the weights, never trained): its gradient is
    exactly zero and it takes no weight decay (``FlatLayout``), so AdamW leaves it as it is."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    name: str
    """``embed``, ``layers.{i}`` or ``head``."""
    kind: str
    """``pre``, ``layer`` or ``post``."""
    index: int
    """Layer index for ``layer`` units, -1 otherwise."""
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass
class LayerContext:
    """What every layer of one micro-batch reads besides its input: positions, RoPE, masks,
    and (MoE with the aux loss) where router logits go. Built once per micro-batch on the
    device; every tensor here lives as long as the micro-batch."""

    position_ids: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """``(cos, sin)`` per RoPE key (the layer type when the family's RoPE differs by type)."""
    masks: dict[str, torch.Tensor | None]
    layout: RowLayout
    router: RouterState | None = None

    def shared_tensors(self) -> list[torch.Tensor]:
        """The tensors every layer shares (kept internals keep them by reference)."""
        out = [self.position_ids, *(t for cs in self.rope.values() for t in cs)]
        return out + [m for m in self.masks.values() if m is not None]


@dataclass
class _Template:
    module: nn.Module
    frozen: tuple[str, ...] = ()
    """Local names of the persistent buffers (frozen tensors)."""
    runs_per_example: bool = False
    """A recurrent token mixer: a packed row runs example by example."""
    has_router: bool = False


class DecoderAdapter:
    """The layer view of one HF decoder family (``families.FAMILIES``)."""

    def __init__(self, config: PretrainedConfig):
        spec = family_of(config)
        self.family = spec.model_type
        self.spec = spec
        self.config = config
        self.attn_implementation = attn_implementation(config)
        config._attn_implementation = self.attn_implementation
        self.num_layers: int = config.num_hidden_layers
        self.tied: bool = bool(getattr(config, "tie_word_embeddings", False))
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        with torch.device("meta"):
            self._meta = spec.model_class(config)
        self._meta.eval()  # dropout off, as in the engine's every step
        inner = _decoder_base(self._meta, self.family)
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self.layer_types: list[str] = layer_attention_types(config)
        self.layer_windows = layer_windows(config)
        self.router_spec = RouterSpec.of(self._meta, config)
        self._recorder = RouterRecorder(self.router_spec) if self.router_spec else None

        units = [self._unit(EMBED, "pre", -1, inner.embed_tokens, HF_EMBED_PREFIX)]
        for i, layer in enumerate(inner.layers):
            units.append(self._unit(layer_unit(i), "layer", i, layer, HF_LAYER_PREFIX.format(i)))
        head_params = [ParamSpec("norm." + n, HF_NORM_PREFIX + n, tuple(p.shape))
                       for n, p in inner.norm.named_parameters()]
        if not self.tied:
            head_params.append(ParamSpec("lm_head.weight", "lm_head.weight",
                                         tuple(self._meta.lm_head.weight.shape)))
        units.append(Unit(HEAD, "post", -1, tuple(head_params)))
        self.units: tuple[Unit, ...] = tuple(units)
        self.unit_by_name = {u.name: u for u in self.units}

        self._template_of_layer: list[_Template] = []
        templates: dict[tuple, _Template] = {}
        for i, layer in enumerate(inner.layers):
            key = (self.layer_types[i], tuple((p.local, p.shape) for p in self.units[1 + i].params),
                   _module_settings(layer))
            if key not in templates:
                templates[key] = self._template(layer, self.units[1 + i], self.layer_types[i])
            self._template_of_layer.append(templates[key])
        self.num_templates = len(templates)
        self.router_layers = tuple(i for i, t in enumerate(self._template_of_layer) if t.has_router)
        self._embed_template = inner.embed_tokens
        self._head_template = _causal_lm_head(self._meta)
        self._rotary_template = getattr(inner, "rotary_emb", None)
        typed = self._rotary_template is not None and \
            "layer_type" in inspect.signature(type(self._rotary_template).forward).parameters
        self._rope_key = [t if typed else "" for t in self.layer_types]
        self._embed_scale = embedding_scale(inner, config)

    @staticmethod
    def _unit(name: str, kind: str, index: int, module: nn.Module, prefix: str) -> Unit:
        params = [ParamSpec(n, prefix + n, tuple(p.shape)) for n, p in module.named_parameters()]
        saved = module.state_dict(keep_vars=True)
        params += [ParamSpec(n, prefix + n, tuple(b.shape), trainable=False)
                   for n, b in module.named_buffers() if n in saved]
        return Unit(name, kind, index, tuple(params))

    def _template(self, layer: nn.Module, unit: Unit, layer_type: str) -> _Template:
        saved = layer.state_dict(keep_vars=True)
        transient = [n for n, _ in layer.named_buffers() if n not in saved]
        if transient:
            raise ValueError(f"{self.family} layers hold buffers that are not saved with the "
                             f"weights ({transient[:3]}); layerwise cannot run such a layer from "
                             "its weights alone")
        frozen = tuple(p.local for p in unit.params if not p.trainable)
        has_router = self._recorder.attach(layer) if self._recorder else False
        return _Template(layer, frozen, layer_type == LINEAR_ATTENTION, has_router)

    # ----- structure ---------------------------------------------------------------------

    @property
    def layer_units(self) -> tuple[Unit, ...]:
        return self.units[1:-1]

    def layer_module(self, index: int) -> nn.Module:
        """The meta module of layer ``index`` (structure only: sizes, submodules)."""
        return self._meta.model.layers[index]

    def hf_names(self) -> list[str]:
        """Every HF state-dict key that carries a distinct tensor (tied head excluded)."""
        return [p.hf_name for u in self.units for p in u.params]

    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    def new_rotary(self, device: torch.device | str) -> nn.Module | None:
        """A real (non-meta) rotary-embedding module; it has buffers but no parameters (None:
        the family's layers make their own positions)."""
        if self._rotary_template is None:
            return None
        rotary_cls = type(self._rotary_template)
        return rotary_cls(config=self.config).to(device)

    # ----- per micro-batch ----------------------------------------------------------------

    def layer_context(self, shape: tuple[int, int], device: torch.device | str, dtype: torch.dtype,
                      rotary: nn.Module, segment_ids: torch.Tensor | None = None,
                      router: bool = False) -> LayerContext:
        """Positions, RoPE and masks of a ``[b, s]`` micro-batch (``segment_ids``: which example
        each position holds, -1 padding; None: one example a row). ``router``: record the router
        logits for the aux loss (training; the family has it)."""
        device = torch.device(device)
        layout = row_layout(tuple(shape), segment_ids)
        pos = layout.positions.to(device, non_blocking=True)
        probe = torch.empty(0, dtype=dtype, device=device)  # RoPE reads only its dtype and device
        axes = self.spec.rope_position_axes
        rope_pos = pos[None].expand(axes, *pos.shape) if axes else pos
        rope = {}
        with torch.no_grad():
            for key in sorted(set(self._rope_key)):
                if rotary is None:
                    rope[key] = None
                else:
                    rope[key] = rotary(probe, rope_pos, key) if key else rotary(probe, rope_pos)
        masks = attention_masks(self.layer_types, self.layer_windows, layout,
                                self.attn_implementation, dtype, device)
        state = None
        if router and self.router_spec is not None:
            mask = None
            if segment_ids is not None and bool((segment_ids < 0).any()):
                mask = (segment_ids >= 0).to(device=device, dtype=torch.long)
            state = RouterState(mask)
        return LayerContext(pos, rope, masks, layout, state)

    # ----- computation (pure functions of the given parameters) ---------------------------

    def embed(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        w = params["weight"]
        return self._scaled(F.embedding(input_ids, w, self._embed_template.padding_idx))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` times the embedding scale, rounded as the family's code rounds it."""
        if self._embed_scale is None:
            return h
        scale, cast = self._embed_scale
        return h * torch.tensor(scale, device=h.device).to(h.dtype) if cast else h * scale

    def embed_weight_grad(self, input_ids: torch.Tensor, grad_out: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient of :meth:`embed`'s weight from the token ids and the gradient of its
        output alone (the weights are never read): the dense embedding backward autograd runs,
        so the values are autograd's. ``out``: a ``[vocab, hidden]`` buffer to write it into."""
        grad_out = self._scaled(grad_out)
        pad = self._embed_template.padding_idx
        pad = -1 if pad is None else pad
        rows = self._embed_template.num_embeddings
        if out is None:
            return torch.ops.aten.embedding_dense_backward(grad_out, input_ids, rows, pad, False)
        return torch.ops.aten.embedding_dense_backward.out(grad_out, input_ids, rows, pad, False, out=out)

    def layer(self, index: int, params: dict[str, torch.Tensor], hidden: torch.Tensor,
              ctx: LayerContext, module: nn.Module | None = None) -> torch.Tensor:
        """Decoder layer ``index`` on ``hidden`` ``[b, s, h]``, as HF's model forward runs it.
        ``module``: another template of the layer's structure (a LoRA run's, its linears
        swapped), run the same way."""
        t = self._template_of_layer[index]
        if module is not None:
            t = dataclasses.replace(t, module=module)
        record = ctx.router is not None and t.has_router
        if record:
            self._recorder.start()
        try:
            if t.runs_per_example and ctx.layout.packed:
                y = self._layer_per_example(t, index, params, hidden, ctx)
            else:
                y = self._call(t, index, params, hidden, ctx, ctx.position_ids,
                               ctx.rope[self._rope_key[index]])
        finally:
            logits = self._recorder.stop() if record else None
        if record:
            ctx.router.logits[index] = logits.detach()
        if torch.is_grad_enabled() and (record or t.frozen):
            y = LayerTail.apply(y, ctx.router if record else None, index, logits,
                                *(params[n] for n in t.frozen))
        return y

    def _call(self, t: _Template, index: int, params, hidden, ctx, pos, rope) -> torch.Tensor:
        out = torch.func.functional_call(
            t.module, params, (hidden,),
            {"attention_mask": ctx.masks.get(self.layer_types[index]), "position_ids": pos,
             "position_embeddings": rope},
            strict=True)
        return out[0] if isinstance(out, tuple) else out

    def _layer_per_example(self, t: _Template, index: int, params, hidden, ctx) -> torch.Tensor:
        """A recurrent layer over a packed batch: each example (and padding run) alone, so no
        state or convolution crosses an example; the rest of a layer is per token."""
        cos, sin = ctx.rope[self._rope_key[index]]
        rows = []
        for r in range(hidden.shape[0]):
            parts = [self._call(t, index, params, hidden[r:r + 1, a:e], ctx,
                                ctx.position_ids[r:r + 1, a:e],
                                (cos[..., r:r + 1, a:e, :], sin[..., r:r + 1, a:e, :]))
                     for rr, a, e in ctx.layout.runs if rr == r]
            rows.append(torch.cat(parts, dim=1))
        return torch.cat(rows, dim=0)

    def head_logits(
        self,
        head_params: dict[str, torch.Tensor],
        embed_weight: torch.Tensor | None,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """The logits of ``hidden`` (``[tokens, h]`` or ``[b, s, h]``, before the final norm)
        by the causal LM's own forward: final norm, lm_head and whatever the family does to the
        logits (soft cap, scaling); ``embed_weight`` is the tied head weight (else ignored)."""
        params = {("model." + k if k.startswith("norm.") else k): v for k, v in head_params.items()}
        if self.tied:
            params["lm_head.weight"] = embed_weight
        flat = hidden.dim() == 2
        out = torch.func.functional_call(
            self._head_template, params, (),
            {"inputs_embeds": hidden[None] if flat else hidden, "output_router_logits": False,
             "use_cache": False}, strict=True)
        return out.logits[0] if flat else out.logits

    def router_aux_loss(self, ctx: LayerContext, weight: float) -> torch.Tensor | None:
        """The micro-batch's ``weight * coef * aux`` (``moe.py``), its gradient w.r.t. each MoE
        layer's router logits kept for that layer's backward; None without the aux loss."""
        if ctx.router is None:
            return None
        return ctx.router.aux_loss(self.router_spec, weight)


def _module_settings(layer: nn.Module) -> tuple:
    """What a layer's modules compute with besides their tensors: each submodule's class and
    plain attributes (SmolLM3's per-layer ``use_rope``, DiffLlama's ``lambda_init`` of the
    layer index). Layers that differ here need their own template; ``layer_idx`` itself only
    addresses a KV cache, which the engine never passes."""
    plain = (bool, int, float, str, type(None))
    return tuple((n, type(m).__name__, tuple(sorted(
        (k, v) for k, v in vars(m).items()
        if not k.startswith("_") and k not in ("layer_idx", "training") and isinstance(v, plain))))
        for n, m in layer.named_modules())


def _decoder_base(meta: nn.Module, family: str) -> nn.Module:
    """The base model of causal LM ``meta``, checked to have the parts layerwise streams."""
    inner = getattr(meta, "model", None)
    parts = {"model.embed_tokens": nn.Embedding, "model.layers": nn.ModuleList, "model.norm": nn.Module}
    missing = [n for n, kind in parts.items()
               if not isinstance(getattr(inner, n.split(".")[1], None) if inner is not None else None, kind)]
    if not isinstance(getattr(meta, "lm_head", None), nn.Linear):
        missing.append("lm_head")
    if missing:
        raise ValueError(
            f"unsupported architecture model_type={family!r}: transformers' {type(meta).__name__} "
            f"does not have the decoder layout layerwise streams (model.embed_tokens, model.layers, "
            f"model.norm, lm_head; it lacks {', '.join(missing)}); convert the checkpoint to a "
            "family that has it (e.g. Llama) or open an issue")
    return inner


class _FinalNorm(nn.Module):
    """Stands in for the base model inside the causal LM's forward: the final norm of the hidden
    states it is given as ``inputs_embeds`` (the layers have already run)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs_embeds: torch.Tensor, **_: object) -> _BaseOutput:
        return _BaseOutput(self.norm(inputs_embeds))


class _BaseOutput:
    """The base model's output as the head code reads it: the last hidden state (by name or
    as item 0), and None for whatever else it asks (cache, router logits, attentions)."""

    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getattr__(self, name: str) -> None:  # only for attributes not set above
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


def _causal_lm_head(meta: nn.Module) -> nn.Module:
    """``meta`` (a causal LM on the meta device) with its base model replaced by its final
    norm: calling it runs the family's own head code on given hidden states. A shallow copy
    that shares the lm_head and norm modules with ``meta``."""
    head = copy.copy(meta)
    head._modules = {**meta._modules, "model": _FinalNorm(meta.model.norm)}
    return head


def embedding_scale(inner: nn.Module, config: PretrainedConfig) -> tuple[float, bool] | None:
    """The factor the base model multiplies its token embeddings by, and whether it is cast to
    the weights' dtype first: a scaled embedding module's own (Gemma's ``sqrt(hidden)``, cast;
    its buffer is empty on the meta device, its scalar copy is not) or the config's
    ``embedding_multiplier`` (Granite, a Python float). None: no scale."""
    scale = getattr(inner.embed_tokens, "scalar_embed_scale", None)
    cast = scale is not None
    if not cast:
        scale = getattr(config, "embedding_multiplier", None)
    return None if scale is None or float(scale) == 1.0 else (float(scale), cast)
