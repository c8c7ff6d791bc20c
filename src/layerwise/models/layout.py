"""Where a causal LM keeps the parts layerwise streams, found on its own (meta) modules.

Decoders share one shape under many names (Llama, GPT-2, GPT-NeoX, OPT, ...), so
:func:`decoder_layout` reads them off the model instead of a table: the embedding and head via
``get_input_embeddings``/``get_output_embeddings``, the layers' ``ModuleList``, and what runs
around the layers traced by running the base model on meta with each layer replaced by a probe."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

LAYER_INPUTS = frozenset({"attention_mask", "position_ids", "position_embeddings"})
"""What the engine gives a layer besides its hidden states (``adapter.LayerContext``)."""

_IGNORED_KINDS = (nn.Dropout,)


@dataclass(frozen=True)
class DecoderLayout:
    base: str
    """Path of the module holding the layers (``model``, ``transformer``, ``model.decoder``)."""
    embed: str
    """The token embedding's attribute on ``base``."""
    pre: tuple[str, ...]
    """Other parts of ``base`` with tensors that run before the layers (learned positions)."""
    layers: str
    post: tuple[str, ...]
    """Parts of ``base`` with tensors that run after the layers, in order (final norm, …)."""
    head: str
    """The lm_head's attribute on the causal LM (``lm_head``, ``embed_out``)."""
    rotary: str | None
    """The base's rotary-embedding module (None: the layers make their own positions)."""
    layer_inputs: frozenset[str]
    """Of :data:`LAYER_INPUTS`, what the base model gives its layers."""
    none_inputs: frozenset[str]
    """Arguments the base model gives its layers as None that their forward requires (Falcon's
    ``alibi`` when it uses RoPE instead)."""
    masked_layers: frozenset[int]
    """Layers the base model gives a 4-D attention mask (under eager attention); the others
    (a recurrent token mixer, or a layer that masks on its own) get none from the engine."""

    def prefix(self, part: str) -> str:
        """The state-dict key prefix of part ``part`` of ``base``."""
        return f"{self.base}.{part}."

    def layer_prefix(self, i: int) -> str:
        return f"{self.base}.{self.layers}.{i}."


def decoder_layout(meta: nn.Module, family: str, num_layers: int) -> DecoderLayout:
    """The layout of causal LM ``meta`` (on the meta device; a multimodal model's language
    model, of ``num_layers`` layers), or a one-line error."""
    head_module = meta.get_output_embeddings()
    embed_module = meta.get_input_embeddings()
    names = {id(m): n for n, m in meta.named_modules()}
    head = names.get(id(head_module), "")
    embed_path = names.get(id(embed_module), "")
    base_path, _, embed = embed_path.rpartition(".")
    base = meta.get_submodule(base_path) if base_path else None
    layers = None if base is None else next(
        (n for n, c in base.named_children()
         if isinstance(c, nn.ModuleList) and len(c) == num_layers), None)
    missing = [what for what, ok in (
        ("a token embedding", isinstance(embed_module, nn.Embedding) and bool(base_path)),
        ("a ModuleList of num_hidden_layers layers beside it", layers is not None),
        ("an lm_head", isinstance(head_module, nn.Linear) and "." not in head)) if not ok]
    stack = next((n for n, m in meta.named_modules()
                  if isinstance(m, nn.ModuleList) and len(m) == num_layers), None)
    if missing and stack and "encoder" in stack.split("."):
        raise ValueError(
            f"unsupported architecture model_type={family!r}: transformers' {type(meta).__name__} "
            f"is an encoder model (its layers are {stack}, BERT-style), and layerwise trains "
            "decoder-only causal LMs; use a decoder-only checkpoint")
    if missing:
        raise ValueError(
            f"unsupported architecture model_type={family!r}: transformers' {type(meta).__name__} "
            f"does not have the decoder layout layerwise streams (it lacks {', '.join(missing)}); "
            "convert the checkpoint to a family that has it (e.g. Llama) or open an issue")
    extra = [n for n, _ in embed_module.named_parameters() if n != "weight"]
    if extra:
        raise ValueError(
            f"unsupported architecture model_type={family!r}: its token embedding "
            f"({type(embed_module).__name__}) has {', '.join(extra)} besides its table (a norm of "
            "the embeddings, not affine), which the embedding unit does not compute; open an "
            "issue if you need it")
    tensors = sorted(k for k, v in vars(base).items() if isinstance(v, torch.Tensor))
    if tensors:
        raise ValueError(
            f"unsupported architecture model_type={family!r}: its base model keeps "
            f"{', '.join(tensors)} as a plain tensor (neither saved nor a buffer), which "
            "layerwise cannot stream; open an issue if you need it")
    order, inputs, masked, nones = _trace(base, layers, family)
    first, last = order.index(layers), len(order) - 1 - order[::-1].index(layers)
    children = dict(base.named_children())

    def weighted(n: str) -> bool:
        return next(children[n].parameters(), None) is not None

    pre = [n for n in dict.fromkeys(order[:first]) if n != embed]
    post = [n for n in dict.fromkeys(order[last + 1:]) if not isinstance(children[n], _IGNORED_KINDS)]
    rotary = "rotary_emb" if "rotary_emb" in children else None  # some call it inside the loop
    for n in pre:
        m = children[n]
        table = next(m.parameters(), None) is None and next(m.buffers(), None) is not None
        if n == rotary or isinstance(m, (*_IGNORED_KINDS, nn.Embedding)) or table:
            continue  # a position table (XGLM's sinusoids) adds a constant: still affine
        raise ValueError(
            f"unsupported architecture model_type={family!r}: its base model runs "
            f"{n} ({type(m).__name__}) on the embeddings before the first layer, and layerwise "
            "streams only token and position embeddings there; open an issue if you need it")
    unknown = sorted(inputs - LAYER_INPUTS - {"cache", "past_key_values", "layer_past"})
    if unknown:
        raise ValueError(
            f"unsupported architecture model_type={family!r}: its base model gives every layer "
            f"{', '.join(unknown)}, which layerwise does not compute; open an issue if you need it")
    if _uses_alibi(base):  # after the trace's refusals: theirs say more where they apply
        raise ValueError(
            f"unsupported architecture model_type={family!r}: its base model adds ALiBi biases "
            "to the attention it gives its layers, which layerwise does not compute; use a "
            "checkpoint with rotary positions or open an issue")
    both_ways = getattr(getattr(base, "config", None), "use_bidirectional_attention", None)
    if both_ways is True or both_ways == "all":  # "vision": over image tokens, none in text
        raise ValueError(
            f"unsupported architecture model_type={family!r}: its layers attend in both "
            f"directions (use_bidirectional_attention={both_ways!r}), and layerwise's masks are "
            "causal; set it to None for causal-LM training or open an issue")
    return DecoderLayout(base_path, embed, tuple(n for n in pre if weighted(n) and n != rotary),
                         layers, tuple(post), head, rotary, frozenset(inputs & LAYER_INPUTS),
                         frozenset(nones - LAYER_INPUTS), frozenset(masked))


def _uses_alibi(base: nn.Module) -> bool:
    """Whether the base model biases attention by ALiBi, read from its flags or its own builder:
    newer transformers fold the biases into the mask (Falcon since 5.25), where the trace cannot see
    them."""
    config = getattr(base, "config", None)
    owners = (config, base, getattr(config, "attn_config", None))
    if getattr(config, "position_embedding_type", None) == "alibi":
        return True
    flags = [getattr(o, n, None) for o in owners for n in ("alibi", "use_alibi")]
    if any(isinstance(f, bool) for f in flags):
        return True in flags
    return any("alibi" in name for name in dir(type(base)))


class _LayerProbe(nn.Module):
    """Stands in for every layer during the trace: records that the layers ran and which tensor
    arguments they were given, and passes the hidden states through (as a tuple where the
    base model reads the layer's output as one)."""

    def __init__(self, signature: inspect.Signature, order: list[str], name: str,
                 inputs: set[str], masked: set[int], as_tuple: bool):
        super().__init__()
        self.signature, self.order, self.name = signature, order, name
        self.inputs, self.masked, self.as_tuple = inputs, masked, as_tuple
        self.nones: set[str] = set()
        self.required = {n for n, p in signature.parameters.items()
                         if p.default is inspect.Parameter.empty and n != "self"}

    def forward(self, *args, **kwargs):
        bound = self.signature.bind_partial(None, *args, **kwargs).arguments
        bound.pop("self", None)
        extra = bound.pop("kwargs", {})
        hidden = bound.pop(next(iter(bound)))
        self.order.append(self.name)
        for k, v in {**bound, **extra}.items():
            if k in LAYER_INPUTS or isinstance(v, torch.Tensor) or (
                    isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor)):
                self.inputs.add(k)
            if v is None and k in self.required:
                self.nones.add(k)
            if k == "attention_mask" and isinstance(v, torch.Tensor) and v.dim() == 4:
                self.masked.add(self.layer_index)
        return (hidden,) if self.as_tuple else hidden


def _trace(base: nn.Module, layers: str, family: str
           ) -> tuple[list[str], set[str], set[int], set[str]]:
    """The order in which the base model's direct children run (the layers as ``layers``), the
    names of the arguments its layers get, and which layers get a 4-D attention mask, from
    one meta-device forward with eager attention (so every attention layer gets its mask; a
    recurrent layer gets none, or the 2-D padding mask)."""
    real = getattr(base, layers)
    signature = inspect.signature(type(real[0]).forward)
    seq = 8
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    config = base.config
    eager = copy.deepcopy(config)  # the base's own: the config object is shared, maybe by a running model
    eager._attn_implementation = "eager"
    # A cache makes the mask code skip its packed-rows probe, which reads the position ids'
    # values (none on the meta device); what the layers get is the same either way, and a
    # training run leaves ``use_cache: false`` in every checkpoint it writes.
    eager.use_cache = True
    error: Exception | None = None
    for as_tuple in (False, True):
        order: list[str] = []
        inputs: set[str] = set()
        masked: set[int] = set()
        probes = []
        for i, layer in enumerate(real):
            probe = _LayerProbe(signature, order, layers, inputs, masked, as_tuple)
            probe.__dict__.update({k: v for k, v in vars(layer).items()
                                   if not k.startswith("_") and k != "training"})
            probe.layer_index = i
            probes.append(probe)
        hooks = [c.register_forward_pre_hook(lambda _m, _a, n=n: order.append(n))
                 for n, c in base.named_children() if n != layers]
        setattr(base, layers, nn.ModuleList(probes))
        base.config = eager
        try:
            with torch.no_grad():
                out = base(input_ids=ids)
            hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
            if layers in order and tuple(hidden.shape[:2]) == (1, seq):
                return order, inputs, masked, set().union(*(p.nones for p in probes))
        except Exception as e:  # noqa: BLE001 — reported below if no return convention works
            error = e
        finally:
            base.config = config
            setattr(base, layers, real)
            for h in hooks:
                h.remove()
    why = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}" if error else \
        "the layers' output did not come back as the hidden states"
    raise ValueError(f"unsupported architecture model_type={family!r}: layerwise could not "
                     f"trace its base model's forward on the meta device ({why}); open an issue")
