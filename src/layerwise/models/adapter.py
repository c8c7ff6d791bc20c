"""Split a Hugging Face decoder LM into ``pre | layers[i] | post`` units, with HF key maps.

A *unit* is what layerwise stores, streams, updates and checkpoints as one piece:

- ``embed``: the token embedding (``model.embed_tokens.weight``); with tied embeddings it also
  serves as the lm_head, so a tied head has no weights of its own;
- ``layers.{i}``: decoder block ``i`` (``model.layers.{i}.*``);
- ``head``: the final norm and, when untied, ``lm_head.weight``.

The adapter owns the computation of each unit as a pure function of its parameters (through
``torch.func.functional_call`` on meta-device template modules), so the engine can run any
layer on views of a flat device buffer without materialising a module per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from .families import SLIDING_ATTENTION, family_of, layer_attention_types
from .names import EMBED, HEAD, HF_EMBED_PREFIX, HF_LAYER_PREFIX, HF_NORM_PREFIX, layer_unit


@dataclass(frozen=True)
class ParamSpec:
    local: str
    """Name inside the unit's template module, e.g. ``self_attn.q_proj.weight``."""
    hf_name: str
    """Full Hugging Face state-dict key, e.g. ``model.layers.3.self_attn.q_proj.weight``."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


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


class DecoderAdapter:
    """The layer view of one HF decoder family (Llama, Mistral, Qwen2, Qwen3)."""

    def __init__(self, config: PretrainedConfig):
        self.family = family_of(config).model_type
        self.config = config
        # The engine relies on SDPA's is_causal path (no dense mask) for full attention.
        config._attn_implementation = "sdpa"
        self.num_layers: int = config.num_hidden_layers
        self.tied: bool = bool(getattr(config, "tie_word_embeddings", False))
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        causal_cls = family_of(config).model_class
        with torch.device("meta"):
            self._meta = causal_cls(config)
        self._meta.eval()
        inner = self._meta.model
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self.layer_types: list[str] = layer_attention_types(config)

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

        # One template per distinct layer structure (attention type + parameter shapes).
        self._template_of_layer: list[nn.Module] = []
        templates: dict[tuple, nn.Module] = {}
        for i, layer in enumerate(inner.layers):
            key = (self.layer_types[i], tuple((p.local, p.shape) for p in self.units[1 + i].params))
            templates.setdefault(key, layer)
            self._template_of_layer.append(templates[key])
        self.num_templates = len(templates)
        self._embed_template = inner.embed_tokens
        self._head_template = nn.ModuleDict({"norm": inner.norm, "lm_head": self._meta.lm_head})
        self._rotary_template = inner.rotary_emb

    @staticmethod
    def _unit(name: str, kind: str, index: int, module: nn.Module, prefix: str) -> Unit:
        params = tuple(ParamSpec(n, prefix + n, tuple(p.shape)) for n, p in module.named_parameters())
        return Unit(name, kind, index, params)

    # ----- structure ---------------------------------------------------------------------

    @property
    def layer_units(self) -> tuple[Unit, ...]:
        return self.units[1:-1]

    def hf_names(self) -> list[str]:
        """Every HF state-dict key that carries a distinct tensor (tied head excluded)."""
        return [p.hf_name for u in self.units for p in u.params]

    def hf_to_unit(self) -> dict[str, tuple[str, str]]:
        """HF key -> (unit name, local name)."""
        out = {p.hf_name: (u.name, p.local) for u in self.units for p in u.params}
        if self.tied:
            out["lm_head.weight"] = (EMBED, "weight")
        return out

    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    def boundary_numel(self, micro_batch_size: int, seq_len: int) -> int:
        """Elements of one activation at a layer boundary (``[batch, seq, hidden]``)."""
        return micro_batch_size * seq_len * self.hidden_size

    def new_rotary(self, device: torch.device | str) -> nn.Module:
        """A real (non-meta) rotary-embedding module; it has buffers but no parameters."""
        rotary_cls = type(self._rotary_template)
        return rotary_cls(config=self.config).to(device)

    # ----- computation (pure functions of the given parameters) ---------------------------

    def embed(self, params: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, params["weight"], self._embed_template.padding_idx)

    def embed_weight_grad(self, input_ids: torch.Tensor, grad_out: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient of :meth:`embed`'s weight from the token ids and the gradient of its
        output alone (the weights are never read): the dense embedding backward autograd runs,
        so the values are autograd's. ``out``: a ``[vocab, hidden]`` buffer to write it into."""
        pad = self._embed_template.padding_idx
        pad = -1 if pad is None else pad
        rows = self._embed_template.num_embeddings
        if out is None:
            return torch.ops.aten.embedding_dense_backward(grad_out, input_ids, rows, pad, False)
        return torch.ops.aten.embedding_dense_backward.out(grad_out, input_ids, rows, pad, False, out=out)

    def attention_masks(self, seq_len: int, device: torch.device) -> dict[str, torch.Tensor | None]:
        """Masks per attention type; ``None`` means plain causal (SDPA ``is_causal``)."""
        masks: dict[str, torch.Tensor | None] = {"full_attention": None}
        if SLIDING_ATTENTION in self.layer_types:
            w = self.sliding_window
            if w is None or seq_len <= w:
                masks[SLIDING_ATTENTION] = None
            else:
                q = torch.arange(seq_len, device=device)[:, None]
                k = torch.arange(seq_len, device=device)[None, :]
                masks[SLIDING_ATTENTION] = ((k <= q) & (q - k < w))[None, None]
        return masks

    def layer(
        self,
        index: int,
        params: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        masks: dict[str, torch.Tensor | None],
    ) -> torch.Tensor:
        template = self._template_of_layer[index]
        out = torch.func.functional_call(
            template,
            params,
            (hidden,),
            {
                "attention_mask": masks[self.layer_types[index]],
                "position_ids": position_ids,
                "position_embeddings": position_embeddings,
            },
            strict=True,
        )
        return out[0] if isinstance(out, tuple) else out

    def head_logits(
        self,
        head_params: dict[str, torch.Tensor],
        embed_weight: torch.Tensor | None,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Final norm + lm_head; ``embed_weight`` is the tied head weight (else ignored)."""
        norm_params = {k[len("norm."):]: v for k, v in head_params.items() if k.startswith("norm.")}
        h = torch.func.functional_call(self._head_template["norm"], norm_params, (hidden,), strict=True)
        weight = embed_weight if self.tied else head_params["lm_head.weight"]
        return F.linear(h, weight)
