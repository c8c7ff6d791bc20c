"""Split a Hugging Face decoder LM into ``pre | layers[i] | post`` units, with HF key maps.

A layer runs as HF's own module through a functional call on a meta-device template, so it is a
pure function of the parameters given and the engine runs it on views of a flat device buffer;
one template serves every layer of the same structure. The head is the causal LM's own forward
with its base model replaced by what runs after the layers. A template is only right with the
names, buffers and call arguments the adapter gives it, so both are read in one place."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from .attention import RowLayout, attention_masks, row_layout
from .families import (LINEAR_ATTENTION, attn_implementation, family_of, layer_attention_types,
                       layer_windows, text_config)
from .moe import LayerTail, RouterRecorder, RouterSpec, RouterState
from .layout import DecoderLayout, decoder_layout
from .names import EMBED, HEAD, layer_unit, model_is_tied


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
        out = [self.position_ids, *(t for cs in self.rope.values() if cs is not None for t in cs)]
        return out + [m for m in self.masks.values() if m is not None]


@dataclass
class _Template:
    module: nn.Module
    frozen: tuple[str, ...] = ()
    """Local names of the persistent buffers (frozen tensors)."""
    runs_per_example: bool = False
    """A recurrent token mixer: a packed row runs example by example."""
    has_router: bool = False
    masked: bool = True
    """The layer takes the attention mask of its type (else none: a recurrent mixer)."""
    inputs: frozenset[str] = frozenset({"attention_mask", "position_ids", "position_embeddings"})
    """The context arguments the layer is called with (what its base model gives it)."""
    transient: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Buffers the layer computes at construction and does not save (GPT-Neo's causal mask),
    on the host; given to each call on its device."""


_CONTEXT_MASK = object()
"""``DecoderAdapter._call``'s default: the micro-batch context's mask of the layer's type."""

_Slot = tuple[dict, str, str]
_SLOTS: weakref.WeakKeyDictionary[nn.Module, tuple[_Slot, ...] | None] = weakref.WeakKeyDictionary()
"""Template -> (its owner's ``_parameters`` or ``_buffers``, the leaf name, the full name) of
every tensor it holds; None where it holds one tensor under two names (looked up once)."""


def _slots(module: nn.Module) -> tuple[_Slot, ...] | None:
    if module not in _SLOTS:
        out = []
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for store in (sub._parameters, sub._buffers):
                out += [(store, leaf, f"{prefix}.{leaf}" if prefix else leaf)
                        for leaf, t in store.items() if t is not None]
        ids = [id(store[leaf]) for store, leaf, _ in out]
        _SLOTS[module] = tuple(out) if len(set(ids)) == len(ids) else None
    return _SLOTS[module]


def _functional_call(module: nn.Module, params: dict[str, torch.Tensor], args: tuple, kwargs: dict,
                     strict: bool) -> object:
    """``torch.func.functional_call`` with the tensors bound directly in their owners' dicts and put
    back after: functional_call's per-call walk costs ~0.1 ms of host time per op (a 64-wide layer:
    0.57-0.67 ms with it, 0.52-0.54 this way), paid on every op of every step. A template that ties
    tensors, or mismatched names, takes functional_call itself."""
    slots = _slots(module)
    todo = [] if slots is None else [(st, leaf, params[n]) for st, leaf, n in slots if n in params]
    if slots is None or len(todo) != len(params) or (strict and len(todo) != len(slots)):
        return torch.func.functional_call(module, params, args, kwargs, strict=strict,
                                          tie_weights=slots is None)
    own = [store[leaf] for store, leaf, _ in todo]
    try:
        for store, leaf, t in todo:
            store[leaf] = t
        return module(*args, **kwargs)
    finally:
        for (store, leaf, _), t in zip(todo, own):
            store[leaf] = t


class DecoderAdapter:
    """The layer view of one HF decoder family (``families.FAMILIES``)."""

    def __init__(self, config: PretrainedConfig):
        spec = family_of(config)
        self.family = spec.model_type
        self.spec = spec
        self.model_config = config
        """The checkpoint's whole config (a multimodal one's, vision included)."""
        config = text_config(config)
        self.config = config
        """The language model's config (the model's own for a text-only model)."""
        self.attn_implementation = attn_implementation(config, spec)
        self.model_config._attn_implementation = self.attn_implementation
        config._attn_implementation = self.attn_implementation
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        with torch.device("meta"):
            self._meta = spec.model_class(self.model_config)
        self._meta.eval()  # dropout off, as in the engine's every step
        self.tied: bool = model_is_tied(self._meta)
        self.layout = layout = decoder_layout(self._meta, self.family, self.num_layers)
        inner = self._meta.get_submodule(layout.base)
        self._transient = _transient_buffers(spec.model_class, self.model_config, self._meta, layout)
        self._device_buffers: dict[tuple[str, str, torch.dtype], dict[str, torch.Tensor]] = {}
        layers = getattr(inner, layout.layers)
        self._layers = layers
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self._recurrent = tuple(any(isinstance(m, nn.Conv1d) for m in layer.modules())
                                for layer in layers)
        self.layer_types: list[str] = layer_attention_types(config, self._recurrent, spec)
        self.layer_windows = layer_windows(config, self.layer_types)
        self.router_spec = RouterSpec.of(self._meta, config)
        self._recorder = RouterRecorder(self.router_spec) if self.router_spec else None

        embed_module = getattr(inner, layout.embed)
        self.units, head_params = self._split_units(inner, embed_module, layers)
        self.head_weight_name = layout.head + ".weight"
        """The lm_head weight's HF key (the embedding's under tied embeddings)."""
        streamed = {p.hf_name for u in self.units for p in u.params} | {self.head_weight_name}
        self.passthrough_names: tuple[str, ...] = tuple(
            n for n in self._meta.state_dict(keep_vars=True) if n not in streamed)
        """What the checkpoint holds besides the language model (a multimodal model's vision
        tower and projector): never trained, kept on the host as read, exported unchanged."""

        self._template_of_layer = self._layer_templates(layers)
        self.num_templates = len(set(map(id, self._template_of_layer)))
        self.router_layers = tuple(i for i, t in enumerate(self._template_of_layer) if t.has_router)
        self._embed_template = embed_module
        base_buffers = {n[len(layout.base) + 1:]: b for n, b in self._transient.items()
                        if not n.startswith(layout.prefix(layout.layers))}
        own = [n for n in base_buffers  # the base model's own, which its forward may add in
               if not n.startswith(tuple(p + "." for p in (layout.embed, *layout.post)))]
        self._pre_template = _pre_model(inner, layout) if layout.pre or own else None
        self._pre_buffers = base_buffers
        self._head_template, self._head_names = _causal_lm_head(self._meta, layout, head_params)
        self._rotary_template = getattr(inner, layout.rotary) if layout.rotary else None
        typed = self._rotary_template is not None and \
            "layer_type" in inspect.signature(type(self._rotary_template).forward).parameters
        if typed:  # by the config's layer type; a type with no RoPE of its own (LFM's conv) gets none
            kinds = getattr(self._rotary_template, "rope_type", None)
            given = list(getattr(config, "layer_types", None) or self.layer_types)
            self._rope_key = [t if not isinstance(kinds, dict) or t in kinds else "-"
                              for t in given[:self.num_layers]]
        else:
            self._rope_key = [""] * self.num_layers
        self._embed_scale = embedding_scale(embed_module, config)

    def _split_units(self, inner: nn.Module, embed_module: nn.Module, layers: nn.ModuleList
                     ) -> tuple[tuple[Unit, ...], list[ParamSpec]]:
        """The units (embedding and what runs before the layers; each layer; what runs after
        and the head), and the head unit's parameters."""
        layout = self.layout
        embed_params = list(self._params(embed_module, layout.prefix(layout.embed)))
        for name in layout.pre:
            embed_params += self._params(getattr(inner, name), layout.prefix(name), name + ".")
        units = [Unit(EMBED, "pre", -1, tuple(embed_params))]
        for i, layer in enumerate(layers):
            units.append(Unit(layer_unit(i), "layer", i,
                              tuple(self._params(layer, layout.layer_prefix(i)))))
        head_params = []
        for name in layout.post:
            head_params += self._params(getattr(inner, name), layout.prefix(name), name + ".")
        head_module = getattr(self._meta, layout.head)
        head_params += [p for p in self._params(head_module, layout.head + ".", layout.head + ".")
                        if not (self.tied and p.local == layout.head + ".weight")]
        units.append(Unit(HEAD, "post", -1, tuple(head_params)))
        return tuple(units), head_params

    def _layer_templates(self, layers: nn.ModuleList) -> list[_Template]:
        """Each layer's template: one per structure (layer type, mask, parameter shapes,
        module settings), shared by every layer that has it."""
        layout = self.layout
        out: list[_Template] = []
        templates: dict[tuple, _Template] = {}
        for i, layer in enumerate(layers):
            key = (self.layer_types[i], i in layout.masked_layers,
                   tuple((p.local, p.shape) for p in self.units[1 + i].params),
                   _module_settings(layer))
            if key not in templates:
                templates[key] = self._template(layer, self.units[1 + i], i)
            out.append(templates[key])
        return out

    @staticmethod
    def _params(module: nn.Module, prefix: str, local: str = "") -> list[ParamSpec]:
        """The specs of ``module``'s tensors: its parameters, then the persistent buffers HF
        saves with them (frozen); ``local``: the prefix of their names inside the unit."""
        params = [ParamSpec(local + n, prefix + n, tuple(p.shape)) for n, p in module.named_parameters()]
        saved = module.state_dict(keep_vars=True)
        params += [ParamSpec(local + n, prefix + n, tuple(b.shape), trainable=False)
                   for n, b in module.named_buffers() if n in saved]
        return params

    def _template(self, layer: nn.Module, unit: Unit, index: int) -> _Template:
        prefix = self.layout.layer_prefix(index)
        transient = {n[len(prefix):]: b for n, b in self._transient.items() if n.startswith(prefix)}
        frozen = tuple(p.local for p in unit.params if not p.trainable)
        has_router = self._recorder.attach(layer) if self._recorder else False
        return _Template(layer, frozen, self._recurrent[index] or
                         self.layer_types[index] == LINEAR_ATTENTION,
                         has_router, index in self.layout.masked_layers,
                         _accepted(layer, self.layout.layer_inputs), transient)

    # ----- structure ---------------------------------------------------------------------

    @property
    def layer_units(self) -> tuple[Unit, ...]:
        return self.units[1:-1]

    def layer_module(self, index: int) -> nn.Module:
        """The meta module of layer ``index`` (structure only: sizes, submodules)."""
        return self._layers[index]

    def layer_template(self, index: int) -> nn.Module:
        """The module layer ``index`` runs as: one per structure, shared by its layers."""
        return self._template_of_layer[index].module

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
                if rotary is None or key == "-":
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

    def embed(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: the (scaled) token embedding, plus what else the base
        model adds before its layers (learned positions, by its own forward; ``position_ids``
        then says where each token sits in its example)."""
        if self._pre_template is None:
            w = params["weight"]
            return self._scaled(F.embedding(input_ids, w, self._embed_template.padding_idx))
        return self._pre(params, input_ids, position_ids)

    @property
    def traced_embedding(self) -> bool:
        """The first layer's input is the base model's own forward up to its layers (it adds
        more than a scaled token embedding), so its backward is :meth:`embed_grads`'."""
        return self._pre_template is not None

    def _pre(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor,
             position_ids: torch.Tensor | None) -> torch.Tensor:
        named = {(self.layout.embed + "." + k if k == "weight" else k): v for k, v in params.items()}
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        dtype = next((v.dtype for v in params.values() if v.is_floating_point()), torch.float32)
        named.update(self._on(input_ids.device, "pre", self._pre_buffers, dtype))
        out = _functional_call(self._pre_template, named, (),
                               {"input_ids": input_ids, "position_ids": position_ids}, strict=False)
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    def embed_grads(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    grad_out: torch.Tensor) -> list[torch.Tensor]:
        """The gradient of every tensor of the embedding unit (layout order), from the token ids,
        positions and boundary 0's gradient alone: what runs before the layers is affine in
        its tensors (embeddings, checked by ``layout.decoder_layout``), so its vector-Jacobian
        product is the same at any point; taken at zeros, autograd's own backward, in fp32."""
        specs = self.units[0].params
        zeros = {p.local: torch.zeros((), dtype=torch.float32, device=grad_out.device)
                 .expand(p.shape).requires_grad_(p.trainable) for p in specs}
        with torch.enable_grad():
            h = self._pre(zeros, input_ids, position_ids)
            wrt = [zeros[p.local] for p in specs if p.trainable]
            grads = iter(torch.autograd.grad(h, wrt, grad_out.to(h.dtype), allow_unused=True,
                                             materialize_grads=True))
        return [next(grads) if p.trainable else torch.zeros(p.shape, device=grad_out.device)
                for p in specs]

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

    def _call(self, t: _Template, index: int, params, hidden, ctx, pos, rope,
              mask: object = _CONTEXT_MASK) -> torch.Tensor:
        """``mask``: the attention mask to give (default: the context's of the layer's type;
        none for a layer its base model gives none)."""
        if not t.masked:
            mask = None
        elif mask is _CONTEXT_MASK:
            mask = ctx.masks.get(self.layer_types[index])
        if mask is not None and mask.shape[0] != hidden.shape[0]:
            mask = mask.expand(hidden.shape[0], *mask.shape[1:])  # a view; XGLM checks the batch
        given = {"attention_mask": mask, "position_ids": pos, "position_embeddings": rope}
        kwargs = {k: v for k, v in given.items() if k in t.inputs}
        kwargs.update({k: None for k in self.layout.none_inputs if k not in kwargs})
        if t.transient:
            params = {**params, **self._on(hidden.device, f"layer{index}", t.transient, hidden.dtype)}
        out = _functional_call(t.module, params, (hidden,), kwargs, strict=True)
        return out[0] if isinstance(out, (tuple, list)) else out

    def _on(self, device: torch.device, key: str, buffers: dict[str, torch.Tensor],
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``buffers`` on ``device``, the floating ones in the compute ``dtype`` (as a model
        loaded or cast to it holds them: an fp32 causal-mask table would promote a bf16 layer's
        scores, an fp32 position table its embeddings), copied once per device and dtype."""
        cached = self._device_buffers.get((key, str(device), dtype))
        if cached is None:
            cached = self._device_buffers[(key, str(device), dtype)] = {
                n: b.to(device, dtype if b.is_floating_point() else b.dtype)
                for n, b in buffers.items()}
        return cached

    def _layer_per_example(self, t: _Template, index: int, params, hidden, ctx) -> torch.Tensor:
        """A recurrent layer over a packed batch: each example (and padding run) alone, so no
        state or convolution crosses an example; the rest of a layer is per token (and its
        attention, if it has one, takes the mask of one example of the run's length)."""
        rope = ctx.rope[self._rope_key[index]]
        kind, window = self.layer_types[index], self.layer_windows[index]
        rows = []
        for r in range(hidden.shape[0]):
            parts = []
            for rr, a, e in ctx.layout.runs:
                if rr != r:
                    continue
                mask = None
                if t.masked and kind != LINEAR_ATTENTION:
                    mask = attention_masks([kind], (window,), row_layout((1, e - a)),
                                           self.attn_implementation, hidden.dtype,
                                           hidden.device)[kind]
                part_rope = None if rope is None else \
                    tuple(x[..., r:r + 1, a:e, :] for x in rope)
                parts.append(self._call(t, index, params, hidden[r:r + 1, a:e], ctx,
                                        ctx.position_ids[r:r + 1, a:e], part_rope, mask))
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
        params = {self._head_names[k]: v for k, v in head_params.items()}
        if self.tied:
            params[self.head_weight_name] = embed_weight
        flat = hidden.dim() == 2
        out = _functional_call(
            self._head_template, params, (),
            {"inputs_embeds": hidden[None] if flat else hidden, "output_router_logits": False,
             "use_cache": False}, strict=True)
        # squeeze, not [0]: the select's backward would zero-fill a full [1, tokens, vocab]
        return out.logits.squeeze(0) if flat else out.logits

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


def _transient_buffers(model_class: type, config: PretrainedConfig, meta: nn.Module,
                       layout: DecoderLayout) -> dict[str, torch.Tensor]:
    """The buffers of the base model and its layers that are computed at construction and not
    saved (causal-mask tables, position tables; the rotary module's are built by
    ``new_rotary``), by name, on the host: the model is built a second time with only its
    parameters on the meta device, if it has any."""
    saved = meta.state_dict(keep_vars=True)
    skip = layout.prefix(layout.rotary) if layout.rotary else None
    names = [n for n, _ in meta.get_submodule(layout.base).named_buffers(prefix=layout.base)
             if n not in saved and not (skip and n.startswith(skip))]
    if not names:
        return {}
    with _parameters_on_meta():
        real = model_class(config)
    buffers = dict(real.named_buffers())
    return {n: buffers[n] for n in names}


_META_THREADS: set[int] = set()
"""Threads inside :func:`_parameters_on_meta` (the patch applies to them alone)."""
_META_LOCK = threading.Lock()
_REGISTER_PARAMETER = nn.Module.register_parameter


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _REGISTER_PARAMETER(module, name, param)
    if param is not None and threading.get_ident() in _META_THREADS:
        module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules this thread builds inside get their parameters on the meta device (no memory,
    no init cost) and their buffers where they are made; other threads build as usual."""
    me = threading.get_ident()
    with _META_LOCK:
        if not _META_THREADS:
            nn.Module.register_parameter = _register_parameter
        _META_THREADS.add(me)
    try:
        yield
    finally:
        with _META_LOCK:
            _META_THREADS.discard(me)
            if not _META_THREADS:
                nn.Module.register_parameter = _REGISTER_PARAMETER


def _accepted(layer: nn.Module, inputs: frozenset[str]) -> frozenset[str]:
    """Of the context arguments the base model gives its layers, those ``layer``'s forward
    takes (by name, or through ``**kwargs``)."""
    params = inspect.signature(type(layer).forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return inputs
    return frozenset(n for n in inputs if n in params)


def _with_parts(module: nn.Module, parts: dict[str, nn.Module | None]) -> nn.Module:
    """A shallow copy of ``module`` with some children replaced (None: removed)."""
    out = copy.copy(module)
    out._modules = {**module._modules, **parts}
    return out


def _pre_model(inner: nn.Module, layout: DecoderLayout) -> nn.Module:
    """The base model with no layers and nothing after them: its forward is what runs before
    the first layer (token and position embeddings, scale)."""
    parts: dict[str, nn.Module | None] = {layout.layers: nn.ModuleList()}
    parts.update({n: nn.Identity() for n in layout.post})
    if layout.rotary:
        parts[layout.rotary] = _NoRotary()
    return _with_parts(inner, parts)


class _NoRotary(nn.Module):
    """The rotary module inside the embedding's forward, whose output no layer reads there."""

    def forward(self, x: torch.Tensor, *_: object, **__: object) -> tuple[None, None]:
        return None, None


class _FinalNorm(nn.Module):
    """Stands in for the base model inside the causal LM's forward: what runs after the layers
    (the final norm, …), in order, on the hidden states given as ``inputs_embeds``; its
    modules keep their names, so the head's tensors keep their HF names."""

    def __init__(self, post: list[tuple[str, nn.Module]]):
        super().__init__()
        self._order = [n for n, _ in post]
        for n, module in post:
            self.add_module(n, module)

    def forward(self, *_: object, inputs_embeds: torch.Tensor, **__: object) -> _BaseOutput:
        h = inputs_embeds
        for n in self._order:
            h = self._modules[n](h)
        return _BaseOutput(h)


class _BaseOutput:
    """The base model's output as the head code reads it: the last hidden state (by name, as
    item 0 or as a mapping), and None for whatever else it asks (cache, router logits)."""

    def __init__(self, last_hidden_state: torch.Tensor):
        self.last_hidden_state = last_hidden_state

    def __getattr__(self, name: str) -> None:  # only for attributes not set above
        return None

    def keys(self) -> list[str]:  # as a mapping: ``Gemma3ModelOutputWithPast(**outputs)``
        return ["last_hidden_state"]

    def __getitem__(self, index: int | str) -> torch.Tensor:
        if index not in (0, "last_hidden_state"):
            raise IndexError(index)
        return self.last_hidden_state


def _causal_lm_head(meta: nn.Module, layout: DecoderLayout, head_params: list[ParamSpec]
                    ) -> tuple[nn.Module, dict[str, str]]:
    """``meta`` with its base model replaced by what runs after the layers, so calling it runs the
    family's own head code; shallow copies down to the base, sharing modules. Also returns the head
    unit's local names -> the copy's parameter names."""
    inner = meta.get_submodule(layout.base)
    new: nn.Module = _FinalNorm([(n, getattr(inner, n)) for n in layout.post])
    path = layout.base.split(".")
    for depth in range(len(path), 0, -1):
        parent = meta.get_submodule(".".join(path[:depth - 1]))
        parts: dict[str, nn.Module | None] = {path[depth - 1]: new}
        if depth > 1:  # inside the causal LM: what text never runs (a vision tower) is left out
            parts.update({n: None for n in parent._modules if n != path[depth - 1]})
        new = _with_parts(parent, parts)
        if depth > 1:
            new._parameters, new._buffers = {}, {}  # LLaVA-NeXT's image_newline
    posts = tuple(n + "." for n in layout.post)
    names = {p.local: (layout.base + "." + p.local if p.local.startswith(posts) else p.local)
             for p in head_params}
    return new, names


def embedding_scale(embed: nn.Module, config: PretrainedConfig) -> tuple[float, bool] | None:
    """The factor the base model multiplies its token embeddings by, and whether it is cast to the
    weights' dtype first (Gemma's module, Granite's ``embedding_multiplier``, muP's
    ``sqrt(hidden)``). None: no scale."""
    scale = getattr(embed, "scalar_embed_scale", None)
    cast = scale is not None
    if not cast:
        scale = getattr(config, "embedding_multiplier", None)
    if not cast and scale is None and getattr(config, "mup_enabled", None) is True:
        scale = config.hidden_size ** 0.5
    return None if scale is None or float(scale) == 1.0 else (float(scale), cast)
