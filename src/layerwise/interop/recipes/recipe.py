"""Recipe merge: assemble one checkpoint from layer ranges of several checkpoints (LLMTailor-style).

The YAML (mergekit/LLMTailor's shape) is documented in ``docs/formats.md`` ("Recipes"). Layers
keep their positions and every layer must be covered exactly once; each group carries its
optimizer state from the same source as its weights. Relative paths resolve against the current
directory, then the recipe file's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ...models.names import EMBED, LM_HEAD, NORM, config_is_tied, group_of, group_sort_key, layer_index, layer_unit
from ...util.dtypes import parse_dtype
from ..layout import CheckpointSource
from ..sources import open_source

ARCH_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
)
"""Config keys that must agree across all sources: they fix every tensor's shape."""

_TOP_KEYS = {"slices", "pre_weights", "post_weights", "merge_method", "dtype", "state_from", "config"}
_GROUP_ALIASES = {EMBED, NORM, LM_HEAD}


@dataclass(frozen=True)
class LayerSlice:
    """One ``slices`` entry: layers ``[start, end)`` from ``model``."""

    model: str
    """A layer-wise run dir (optionally ``@step``), an HF Trainer checkpoint or an HF model dir."""
    start: int
    end: int
    index: int
    """Position of the slice in the recipe (for error messages)."""


@dataclass(frozen=True)
class PartSource:
    """One ``pre_weights`` / ``post_weights`` entry: a non-layer part (or a whole section) from ``model``."""

    model: str
    name: str | None
    """An HF tensor name or group name; None: the whole section (pre: embedding; post: norm + head)."""
    section: str
    """``pre_weights`` or ``post_weights``."""


@dataclass
class Recipe:
    """A parsed, structurally valid recipe; :meth:`open` checks it against the actual sources."""

    slices: list[LayerSlice]
    """Layer ranges, one source each."""
    parts: list[PartSource]
    """Where the embedding, final norm and head come from."""
    dtype: str | None = None
    """Output weight dtype (None: as stored)."""
    state_from: str | None = None
    """The model whose step, scheduler, RNG and trainer state the output gets."""
    base_dir: Path = field(default_factory=Path.cwd)
    """The recipe file's directory, for relative paths."""
    config: str | None = None
    """The HF config (a config.json or an HF model dir) of DCP sources that record none."""

    def open(self) -> RecipeSource:
        return RecipeSource(self)


def _err(where: str, what: str) -> ValueError:
    return ValueError(f"recipe: {where}: {what}")


def parse_recipe(data: Any, base_dir: Path | None = None) -> Recipe:
    """Validate the YAML structure (types, keys, ranges) without opening any source."""
    if not isinstance(data, dict):
        raise _err("top level", "expected a mapping with 'slices' (see `layerwise ckpt merge --help`)")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise _err("top level", f"unknown key(s) {sorted(unknown)}; known keys are {sorted(_TOP_KEYS)}")
    method = data.get("merge_method", "passthrough")
    if method != "passthrough":
        raise _err(
            "merge_method",
            f"{method!r} blends weights; layerwise merges checkpoints by selecting layers, so only "
            "'passthrough' (or leaving merge_method out) is supported",
        )
    raw_slices = data.get("slices")
    if not isinstance(raw_slices, list) or not raw_slices:
        raise _err("slices", "expected a non-empty list of '- sources: [{model: PATH, layer_range: [a, b]}]'")
    slices: list[LayerSlice] = []
    for i, s in enumerate(raw_slices):
        where = f"slices[{i}]"
        if not isinstance(s, dict) or set(s) - {"sources"} or not isinstance(s.get("sources"), list):
            raise _err(where, "expected '- sources: [{model: PATH, layer_range: [a, b]}]' and nothing else")
        if len(s["sources"]) != 1:
            raise _err(
                where,
                f"has {len(s['sources'])} sources; several sources in one slice means blending them, "
                "but a checkpoint merge takes each layer from exactly one source. Split it into one "
                "slice per source.",
            )
        src = s["sources"][0]
        if not isinstance(src, dict) or set(src) - {"model", "layer_range"}:
            raise _err(where, "a source has exactly the keys 'model' and 'layer_range'")
        model = _model(src.get("model"), where)
        rng = src.get("layer_range")
        if (not isinstance(rng, list) or len(rng) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in rng)):
            raise _err(where, f"layer_range must be [first, end] (two integers, end exclusive), not {rng!r}")
        a, b = rng
        if a < 0 or b < a:
            raise _err(where, f"layer_range [{a}, {b}] is backwards or negative; write [first, end] with first <= end")
        if a == b:
            continue  # LLMTailor writes [i, i] placeholders: they select nothing
        slices.append(LayerSlice(model, a, b, i))
    if not slices:
        raise _err("slices", "every layer_range is empty; nothing would be merged")
    parts: list[PartSource] = []
    for section in ("pre_weights", "post_weights"):
        raw = data.get(section)
        if raw is None:
            continue
        if isinstance(raw, dict):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise _err(section, "expected a list of '- model: PATH' entries (optionally with 'name')")
        for j, e in enumerate(raw):
            where = f"{section}[{j}]"
            if not isinstance(e, dict) or set(e) - {"model", "name"}:
                raise _err(where, "an entry has 'model' and optionally 'name' (a tensor or group name)")
            name = e.get("name")
            if name is not None and not isinstance(name, str):
                raise _err(where, f"name must be a string, not {name!r}")
            parts.append(PartSource(_model(e.get("model"), where), name, section))
    dtype = data.get("dtype")
    if dtype is not None:
        try:
            parse_dtype(dtype)
        except ValueError as e:
            raise _err("dtype", str(e)) from None
    state_from = data.get("state_from")
    if state_from is not None:
        state_from = _model(state_from, "state_from")
    config = data.get("config")
    if config is not None and (not isinstance(config, str) or not config):
        raise _err("config", f"expected the path of an HF config.json or of an HF model dir, not {config!r}")
    return Recipe(slices, parts, dtype, state_from, base_dir or Path.cwd(), config)


def _model(value: Any, where: str) -> str:
    if not isinstance(value, (str, Path)) or not str(value):
        raise _err(where, f"'model' must be a path (optionally path@step), not {value!r}")
    return str(value)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not valid YAML: {e}") from None
    return parse_recipe(data, path.parent.resolve())


class RecipeSource:
    """The merged checkpoint a recipe describes, as a :class:`CheckpointSource` (read group by group)."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self._sources: dict[str, CheckpointSource] = {}
        for m in [s.model for s in recipe.slices] + [p.model for p in recipe.parts] + (
            [recipe.state_from] if recipe.state_from else []
        ):
            self._open(m)
        self._config = self._check_configs()
        self.num_layers = int(self._config["num_hidden_layers"])
        self.tied = config_is_tied(self._config)
        self.assignment: dict[str, str] = {}  # group -> model
        self._assign_layers()
        self._assign_parts()
        self._state_model = self._pick_state_model()

    # ----- opening and checking -------------------------------------------------------------

    def _resolve(self, model: str) -> str:
        base, at, step = model.rpartition("@") if "@" in model else (model, "", "")
        p = Path(base)
        if not p.is_absolute() and not p.exists() and (self.recipe.base_dir / p).exists():
            p = self.recipe.base_dir / p
        return f"{p}{at}{step}"

    def _open(self, model: str) -> CheckpointSource:
        if model not in self._sources:
            try:
                config = None if self.recipe.config is None else self._resolve(self.recipe.config)
                self._sources[model] = open_source(self._resolve(model), config=config)
            except (FileNotFoundError, ValueError) as e:
                raise ValueError(f"recipe: cannot open model {model!r}: {e}") from None
        return self._sources[model]

    def _check_configs(self) -> dict:
        ref_model, ref = None, None
        for model, src in self._sources.items():
            cfg = src.model_config()
            if cfg is None:
                continue
            if ref is None:
                ref_model, ref = model, cfg
                continue
            for k in ARCH_KEYS:
                if k in cfg and k in ref and cfg[k] != ref[k]:
                    raise ValueError(
                        f"recipe: {model!r} and {ref_model!r} have different architectures "
                        f"({k}: {cfg.get(k)!r} vs {ref.get(k)!r}); layers can only be mixed between "
                        "checkpoints of one model configuration"
                    )
        if ref is None:
            raise ValueError("recipe: no source has a model config (config.json); cannot check or export the merge")
        return ref

    def _assign_layers(self) -> None:
        owner: dict[int, LayerSlice] = {}
        for s in self.recipe.slices:
            if s.end > self.num_layers:
                raise ValueError(
                    f"recipe: slices[{s.index}] layer_range [{s.start}, {s.end}] reaches past the "
                    f"model's {self.num_layers} layers (valid: 0 <= first < end <= {self.num_layers})"
                )
            for i in range(s.start, s.end):
                if i in owner:
                    o = owner[i]
                    raise ValueError(
                        f"recipe: layer {i} is selected twice, by slices[{o.index}] ({o.model}, "
                        f"[{o.start}, {o.end}]) and slices[{s.index}] ({s.model}, [{s.start}, {s.end}]); "
                        "every layer must come from exactly one source"
                    )
                owner[i] = s
        missing = [i for i in range(self.num_layers) if i not in owner]
        if missing:
            raise ValueError(
                f"recipe: layer(s) {_ranges(missing)} are not covered by any slice; the model has "
                f"{self.num_layers} layers and every one must come from exactly one source"
            )
        for i, s in sorted(owner.items()):
            group = layer_unit(i)
            if group not in self._sources[s.model].groups():
                raise ValueError(f"recipe: {s.model!r} has no {group} (slices[{s.index}])")
            self.assignment[group] = s.model

    def _assign_parts(self) -> None:
        # Every group that is not a layer, in the reference source's order.
        non_layer: set[str] = set()
        for src in self._sources.values():
            non_layer.update(g for g in src.groups() if layer_index(g) is None)
        explicit: dict[str, PartSource] = {}
        whole: dict[str, str] = {}
        for p in self.recipe.parts:
            if p.name is None:
                if p.section in whole and whole[p.section] != p.model:
                    raise ValueError(
                        f"recipe: {p.section} names two models ({whole[p.section]!r}, {p.model!r}) for "
                        "the whole section; use 'name:' entries to split it"
                    )
                whole[p.section] = p.model
                continue
            group = p.name if p.name in _GROUP_ALIASES or p.name in non_layer else group_of(p.name, self.tied)
            if layer_index(group) is not None:
                raise ValueError(
                    f"recipe: {p.section} entry {p.name!r} is part of decoder layer {group}; take layers "
                    "with 'slices', and only the embedding, final norm and head with pre/post_weights"
                )
            if group not in non_layer:
                hint = " (the model ties lm_head to the embedding: the head is 'embed')" if self.tied else ""
                raise ValueError(
                    f"recipe: {p.section} entry {p.name!r} names no part of the model; known parts: "
                    f"{sorted(non_layer, key=group_sort_key)}{hint}"
                )
            prev = explicit.get(group)
            if prev is not None and prev.model != p.model:
                tied = " (with tied embeddings lm_head.weight is the embedding)" if self.tied and group == EMBED else ""
                raise ValueError(
                    f"recipe: {group!r} is taken from both {prev.model!r} and {p.model!r}{tied}; "
                    "name each part once"
                )
            explicit[group] = p
        first, last = self.recipe.slices[0].model, self.recipe.slices[-1].model
        for group in sorted(non_layer, key=group_sort_key):
            if group in explicit:
                model = explicit[group].model
            elif group == EMBED:
                model = whole.get("pre_weights", first)
            else:
                model = whole.get("post_weights", last)
            if group not in self._sources[model].groups():
                raise ValueError(f"recipe: {model!r} has no group {group!r}, which the recipe takes from it")
            self.assignment[group] = model

    def _pick_state_model(self) -> str:
        if self.recipe.state_from is not None:
            return self.recipe.state_from
        best, best_step = None, -1
        for model in dict.fromkeys(self.assignment.values()):
            step = int(self._sources[model].extra_state().get("step") or 0)
            if step > best_step:
                best, best_step = model, step
        assert best is not None
        return best

    # ----- CheckpointSource -----------------------------------------------------------------

    def groups(self) -> list[str]:
        return sorted(self.assignment, key=group_sort_key)

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        try:
            model = self.assignment[group]
        except KeyError:
            raise ValueError(f"the recipe has no group {group!r}; groups: {self.groups()}") from None
        return self._sources[model].load_group(group)

    def model_config(self) -> dict | None:
        return self._sources[self._state_model].model_config() or self._config

    def extra_state(self) -> dict:
        return self._sources[self._state_model].extra_state()

    @property
    def state_source(self) -> CheckpointSource:
        """The source whose step, scheduler, RNG and trainer state the output carries."""
        return self._sources[self._state_model]

    def describe(self) -> dict[str, Any]:
        """Which model each group comes from, and whose state the output carries (for reports)."""
        return {"groups": {g: self.assignment[g] for g in self.groups()}, "state_from": self._state_model}


def _ranges(xs: list[int]) -> str:
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)
