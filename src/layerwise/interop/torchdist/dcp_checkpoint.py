"""torch.distributed.checkpoint (DCP) checkpoints, written and read a group at a time.

Written in ``get_state_dict``'s nesting (``docs/formats.md``), so FSDP2 loads it at any world
size. DCP plans from the whole state dict, so the writer hands it meta tensors resolved as they
are written (``_LazySavePlanner``): one group in memory at a time. A foreign checkpoint is
untrusted: its pickles are read with allow-lists (:class:`_MetadataUnpickler`,
:class:`_DataOnlyLoadPlanner`)."""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader,
                                         FileSystemWriter)
from torch.distributed.checkpoint.metadata import (Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)

from ...models.names import config_is_tied, group_sort_key, groups_of_model
from ...util.safe_load import load_data_file
from ..hf.model_dir import read_json
from ..layout import CONFIG_NAME, EXP_AVG, EXP_AVG_SQ, PARAM, STEP, CheckpointSource, meta_model
from .titan_names import rope_heads, titan_name, titan_rows_to_hf
from ..hf.trainer_checkpoint import AdamWHParams, _param_groups, trainer_param_groups

METADATA_NAME = ".metadata"
"""DCP's metadata file (what marks a directory as a DCP checkpoint)."""

MODEL, OPTIM = "model.", "optim.state."
_MOMENTS = {EXP_AVG: "exp_avg", EXP_AVG_SQ: "exp_avg_sq", STEP: "step"}
_OPTIM_PREFIXES = ("optim.state.", "optimizer.state.", "state.")


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / METADATA_NAME).is_file()


def _quiet_single_process(fn, *args, **kwargs):
    """DCP warns that it runs without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


# ----- writing ---------------------------------------------------------------------------


def _dcp_key(key: str) -> str | None:
    """The DCP FQN of a source tensor key (None: not written, e.g. a tied head's copy)."""
    if key.startswith(PARAM):
        return MODEL + key[len(PARAM):]
    for prefix, field in _MOMENTS.items():
        if key.startswith(prefix):
            return f"{OPTIM}{key[len(prefix):]}.{field}"
    return None


class _LazySavePlanner(DefaultSavePlanner):
    """Resolves each tensor from its source group when DCP writes it, one group cached."""

    def __init__(self, source: CheckpointSource, group_of_fqn: dict[str, str], dtype: torch.dtype | None):
        super().__init__()
        self.source, self.group_of_fqn, self.dtype = source, group_of_fqn, dtype
        self._group: str | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self.group_loads = 0
        """Source groups read while writing (one per group when DCP writes in plan order)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        group = self.group_of_fqn.get(index.fqn)
        if group is None:
            return super().lookup_object(index)  # a non-tensor value (param groups, step)
        if group != self._group:
            self._tensors = _dcp_tensors(self.source.load_group(group), self.dtype)
            self._group = group
            self.group_loads += 1
        return self._tensors[index.fqn]


def _dcp_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for key, t in tensors.items():
        fqn = _dcp_key(key)
        if fqn is None:
            continue
        if fqn.startswith(MODEL):
            t = t if dtype is None else t.to(dtype)
        else:
            t = t.to(torch.float32).reshape(()) if fqn.endswith(".step") else t.to(torch.float32)
        out[fqn] = t.detach().contiguous()
    return out


def write_dcp(source: CheckpointSource, out_dir: Path, config: dict, extra: dict,
              torch_dtype: torch.dtype | None, *, hparams: AdamWHParams | None = None) -> dict[str, Any]:
    """``source`` as a DCP checkpoint in the empty ``out_dir`` (but its config files); a summary."""
    model = meta_model(config)
    names = {n for names in groups_of_model(model).values() for n in names}

    # Pass 1: the plan needs every tensor's shape and dtype; a group at a time, nothing kept.
    state: dict[str, torch.Tensor] = {}
    group_of_fqn: dict[str, str] = {}
    stepped: set[str] = set()
    for group in source.groups():
        metas = {k: t.to("meta") for k, t in source.load_group(group).items()}  # casts copy nothing
        for fqn, t in _dcp_tensors(metas, torch_dtype).items():
            name = fqn[len(MODEL):] if fqn.startswith(MODEL) else fqn[len(OPTIM):].rsplit(".", 1)[0]
            if name not in names:
                raise ValueError(f"group {group!r} has tensor {name!r}, which the model of config.json "
                                 "does not have; the source and its config disagree")
            if not fqn.startswith(MODEL):
                stepped.add(name)
            state[fqn] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            group_of_fqn[fqn] = group
    missing = sorted(names - {f[len(MODEL):] for f in state if f.startswith(MODEL)})
    if missing:
        raise ValueError(f"the source has no weights for {len(missing)} parameter(s) of the model, e.g. "
                         f"{missing[0]}; it is not a complete checkpoint")

    groups = _param_groups(extra, hparams, extra.get("scheduler") or {})
    order = trainer_param_groups(model)
    param_groups = [{**g, "params": list(n)} for g, n in zip(groups, order)]
    # Flat keys, group by group: DCP writes in this order, so each group is read once. They are
    # the FQNs DCP makes of get_state_dict's nesting, so a nested request loads them.
    to_save: dict[str, Any] = {**state, "optim": {"param_groups": param_groups},
                               "train_state": {"step": int(extra.get("step") or 0)}}
    planner = _LazySavePlanner(source, group_of_fqn, torch_dtype)
    _quiet_single_process(dcp.save, to_save, storage_writer=FileSystemWriter(out_dir, thread_count=1),
                          planner=planner)
    files = sorted(f.name for f in Path(out_dir).iterdir() if f.suffix == ".distcp")
    return {"weight_files": files,
            "tensors": len(state), "params_with_optimizer_state": len(stepped),
            "group_loads": planner.group_loads, "groups": len(source.groups())}


# ----- reading ---------------------------------------------------------------------------

_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch dtypes/layouts/memory formats, ``torch.Size`` and the paths
    DCP records (``storage_meta.checkpoint_id``); nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in (
                ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("builtins", "set"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"the DCP metadata needs {module}.{name}, which is not a DCP metadata class; refusing to "
            "unpickle it (a checkpoint from an untrusted source could run code this way)")


class _DataOnlyReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA_NAME
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _DataOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # flat requests only (DCPCheckpointSource)
        self.original_state_dict[read_item.dest_index.fqn] = load_data_file(value)


_ModelConfig = dict | str | Path | None


def read_model_config(config: _ModelConfig, ckpt: Path) -> dict:
    """The HF config for a DCP dir: ``config`` (a dict, a config.json or an HF model dir), else the
    dir's own config.json."""
    if isinstance(config, dict):
        return dict(config)
    if config is not None:
        p = Path(config)
        file = p / CONFIG_NAME if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"model config {p}: no such file (give a config.json or an HF model dir "
                             "holding one)")
        return read_json(file)
    if (ckpt / CONFIG_NAME).is_file():
        return read_json(ckpt / CONFIG_NAME)
    raise ValueError(
        f"{ckpt} has no {CONFIG_NAME}: DCP records no architecture (torchtitan's saves hold no HF "
        "config), so give the model's HF config: `--config path/to/config.json` (or an HF model dir) "
        "on `layerwise ckpt merge/import`, `config:` in a recipe, config= in Python; or copy the "
        "config.json into the checkpoint dir")


class DCPCheckpointSource:
    """A DCP checkpoint dir as a ``CheckpointSource``, with HF or torchtitan Llama names. DCP
    records no architecture: the HF config comes from ``config`` or the dir's config.json, and the
    shapes are checked against it."""

    def __init__(self, path: str | Path, config: _ModelConfig = None):
        self.path = Path(path)
        if not is_dcp_checkpoint(self.path):
            raise ValueError(f"{self.path} is not a torch.distributed.checkpoint dir (no {METADATA_NAME})")
        self._config = read_model_config(config, self.path)
        self._reader = _DataOnlyReader(self.path)
        meta = self._reader.read_metadata()
        self._keys = set(meta.state_dict_metadata)
        self._tensors = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        model = meta_model(self._config)
        self._groups = groups_of_model(model)
        self.layout, self._param_prefix, self._stored = self._find_layout()
        self._check_shapes({n: tuple(p.shape) for n, p in model.named_parameters()})
        self._optim_prefix = self._find_optim_prefix()

    def _names(self) -> list[str]:
        return [n for names in self._groups.values() for n in names]

    def _find_layout(self) -> tuple[str, str, dict[str, str]]:
        """(layout, weight prefix, HF name -> stored name): the first layout holding every parameter."""
        names = self._names()
        layouts = [("hf", {n: n for n in names})]
        titan = {n: titan_name(n) for n in names}
        if all(titan.values()):
            layouts.append(("torchtitan", titan))
        candidates = [(layout, prefix, stored) for layout, stored in layouts for prefix in (MODEL, "")]
        found = [sum(prefix + s in self._tensors for s in stored.values()) for _, prefix, stored in candidates]
        if len(names) in found:
            return candidates[found.index(len(names))]
        _, prefix, stored = candidates[found.index(max(found))]
        missing = [prefix + s for s in stored.values() if prefix + s not in self._tensors]
        held = sorted(k for k in self._tensors if not k.startswith(_OPTIM_PREFIXES))[:4]
        raise ValueError(
            f"{self.path}: {len(missing)} parameter(s) of the config's model are not in the checkpoint "
            f"under HF or torchtitan Llama names (looked for '{missing[0]}'); it holds e.g. "
            f"{', '.join(held) or 'no model tensors'}: another model, or weights named in a way "
            "layerwise does not read")

    def _check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        for name, stored in self._stored.items():
            got = tuple(self._tensors[self._param_prefix + stored].size)
            if got != shapes[name]:
                raise ValueError(f"{self.path}: '{self._param_prefix + stored}' is {list(got)} in the "
                                 f"checkpoint but {name} is {list(shapes[name])} in the config's model; "
                                 "give the config the checkpoint was trained with")

    def _find_optim_prefix(self) -> str | None:
        counts = {p: sum(f"{p}{s}.exp_avg" in self._tensors for s in self._stored.values())
                  for p in _OPTIM_PREFIXES}
        best = max(counts, key=counts.get)
        return best if counts[best] else None

    def groups(self) -> list[str]:
        return sorted(self._groups, key=group_sort_key)

    def hf_names(self) -> list[str]:
        """The parameters the checkpoint holds (a tied head once, as the embedding)."""
        return self._names()

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        if group not in self._groups:
            raise KeyError(f"no group {group!r} in {self.path}; groups: {', '.join(self.groups())}")
        wanted: dict[str, tuple[str, str]] = {}  # DCP key -> (tensor kind, HF name)
        for name in self._groups[group]:
            stored = self._stored[name]
            wanted[self._param_prefix + stored] = (PARAM, name)
            if self._optim_prefix is not None:
                for kind, field in _MOMENTS.items():
                    fqn = f"{self._optim_prefix}{stored}.{field}"
                    if fqn in self._tensors:
                        wanted[fqn] = (kind, name)
        head = self._untied_head(group)
        request = {fqn: torch.empty(tuple(self._tensors[fqn].size), dtype=self._tensors[fqn].properties.dtype)
                   for fqn in [*wanted, *head]}
        self._load(request)
        if head and not torch.equal(request.pop(head[0]), request[head[1]]):
            raise ValueError(f"{self.path}: the config ties lm_head to the embedding, but the checkpoint's "
                             f"{head[0]} differs from {head[1]}: the run had its own output layer; "
                             "give a config with tie_word_embeddings: false")
        out = {}
        for fqn, t in request.items():
            kind, name = wanted[fqn]
            heads = rope_heads(name, self._config) if self.layout == "torchtitan" else None
            if kind == STEP:
                t = t.to(torch.float32).reshape(())
            elif heads is not None:
                t = titan_rows_to_hf(t, heads)
            out[kind + name] = t
        return out

    def _untied_head(self, group: str) -> tuple[str, str] | tuple[()]:
        """(torchtitan's ``output.weight``, its embedding) when reading ``group`` must check them
        equal: a tied config reads no head (as torchtitan's own HF conversion of a tied model does),
        which is only right if the run tied it too."""
        head = self._param_prefix + "output.weight"
        if (self.layout != "torchtitan" or not config_is_tied(self._config) or head not in self._tensors
                or "model.embed_tokens.weight" not in self._groups[group]):
            return ()
        return head, self._param_prefix + "tok_embeddings.weight"

    def _load(self, flat_request: dict[str, Any]) -> None:
        _quiet_single_process(dcp.load, flat_request, storage_reader=self._reader,
                              planner=_DataOnlyLoadPlanner(flatten_state_dict=False))

    def model_config(self) -> dict | None:
        return dict(self._config)

    def extra_state(self) -> dict:
        # torchtitan's last save is model-only by default (no train_state), in a ``step-N`` dir
        named = re.fullmatch(r"step-(\d+)", self.path.name)
        step = int(named.group(1)) if named else 0
        for key in ("train_state.step", "step"):
            if key in self._keys:
                meta = self._tensors.get(key)  # torchtitan's TrainState stores an int32 tensor
                request: dict[str, Any] = {key: 0 if meta is None else torch.empty(
                    tuple(meta.size), dtype=meta.properties.dtype)}
                self._load(request)
                step = int(request[key])
                break
        return {"step": step, "scheduler": None, "rng": None, "trainer_state": None}
