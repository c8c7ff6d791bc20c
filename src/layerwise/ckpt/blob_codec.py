"""Lossless delta coding of a group's fp32 weights against a key frame (blob layout 3,
``docs/formats.md``).

Between two saves of a fine-tune the bf16 high halves of only a few percent of fp32 weights
change, so a delta stores the low halves, a bitmap of changed high halves and those new halves:
about 2.1 + 2f bytes per weight instead of 4. Exact on bit patterns (NaN payloads included).
Never delta-of-delta (a load reads two blobs); the key frame's high-half hash is checked, so a
different key frame fails the load instead of decoding to other weights."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from .content_hash import new_hasher
from .errors import CheckpointCorruptError
from ..optim import quant
from .moments import CODES_M, CODES_V, Q8_BLOCKS, SCALES_M, SCALES_V
from .provider import PARAM

M, V = "exp_avg/", "exp_avg_sq/"

ENCODING_DELTA = "hi-delta"
"""The ``encoding`` metadata of a delta blob (blob layout 3)."""
ENCODINGS = ("plain", "delta", "moments8", "delta+moments8")
"""``CheckpointConfig.encoding`` values: every blob whole; fp32 weights delta-coded (lossless);
fp32 Adam moments stored block-wise 8-bit (``moments8``: lossy, never the default); both."""
KEYFRAME_CHANGED_FRACTION = 0.5
"""A save whose high halves changed in more than this fraction of a group's fp32 weights
(against its key frame) writes a new key frame instead: the delta would save under 44% of the
weights' bytes while every later load of it still reads the old key frame too."""

LO, HI_CHANGED, HI_NEW = "param_lo/", "param_hi_changed/", "param_hi_new/"



@dataclass(frozen=True)
class KeyFrame:
    """A plain blob a delta is coded against: its manifest record."""

    rel: str
    digest: str
    nbytes: int

    def record(self, hash_name: str) -> dict:
        return {"blob": self.rel, hash_name: self.digest, "nbytes": self.nbytes}


def moments_8bit(tensors: dict[str, torch.Tensor],
                 block_size: int = quant.DEFAULT_BLOCK_SIZE) -> dict[str, torch.Tensor]:
    """``tensors`` with fp32 moments stored as 8-bit codes and scales (blob layout 2), which every
    reader turns back into fp32. Lossy (``optim.quant``'s bound): ~2 bytes per parameter, not 8."""
    pairs = [k[len(M):] for k in tensors if k.startswith(M) and V + k[len(M):] in tensors
             and tensors[k].dtype == torch.float32]
    if not pairs:
        return tensors
    coded = {kind + n for n in pairs for kind in (M, V)}
    out = {k: t for k, t in tensors.items() if k not in coded}
    for n in pairs:
        out[CODES_M + n], out[SCALES_M + n] = quant.quantize_signed(tensors[M + n], block_size)
        out[CODES_V + n], out[SCALES_V + n] = quant.quantize_sq(tensors[V + n], block_size)
        out[Q8_BLOCKS + n] = torch.tensor([block_size, 0], dtype=torch.int64)
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).numpy().view(np.uint32)


def high_halves(t: torch.Tensor) -> np.ndarray:
    """The top 16 bits of each fp32 element's bit pattern (uint16)."""
    return (_bits(t) >> 16).astype(np.uint16)


def read_key_frame(path: Path) -> dict[str, np.ndarray]:
    """The high halves of a key frame's fp32 ``param/`` tensors, by blob key (only those
    tensors are read)."""
    with safe_open(str(path), framework="pt") as f:
        return {k: high_halves(f.get_tensor(k)) for k in f.keys()
                if k.startswith(PARAM) and f.get_slice(k).get_dtype() == "F32"}


def _hi_digest(planes: dict[str, np.ndarray], hash_name: str) -> str:
    h = new_hasher(hash_name)
    for k in sorted(planes):
        h.update(memoryview(planes[k]).cast("B"))
    return h.hexdigest()


def encode_delta(tensors: dict[str, torch.Tensor], key: dict[str, np.ndarray], base: KeyFrame,
                 hash_name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """``tensors`` (blob keys) with their fp32 weights coded against the key frame's high
    halves ``key``, and the metadata that names it; None when the high halves changed in more
    than ``KEYFRAME_CHANGED_FRACTION`` of the weights (write a key frame instead)."""
    coded = {k for k, t in tensors.items()
             if k in key and t.dtype == torch.float32 and key[k].size == t.numel()}
    if not coded:
        return None
    out, used, changed_n, total_n = {}, {}, 0, 0
    for k, t in tensors.items():
        if k not in coded:
            out[k] = t
            continue
        bits, name = _bits(t), k[len(PARAM):]
        changed = (bits >> 16).astype(np.uint16) != key[k]
        out[LO + name] = torch.from_numpy((bits & 0xFFFF).astype(np.uint16).view(np.int16))
        out[HI_CHANGED + name] = torch.from_numpy(np.packbits(changed, bitorder="little"))
        out[HI_NEW + name] = torch.from_numpy((bits[changed] >> 16).astype(np.uint16).view(np.int16))
        used[k] = key[k]
        changed_n += int(changed.sum())
        total_n += t.numel()
    if changed_n > KEYFRAME_CHANGED_FRACTION * total_n:
        return None
    meta = {"encoding": ENCODING_DELTA, "base": base.digest,
            f"base_hi_{hash_name}": _hi_digest(used, hash_name),
            "shapes": json.dumps({k[len(PARAM):]: list(tensors[k].shape) for k in sorted(coded)},
                                 separators=(",", ":"))}
    return out, meta


def blob_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(bytes(data[8:8 + n])).get("__metadata__") or {}


def decode(tensors: dict[str, torch.Tensor], meta: dict[str, str], hash_name: str,
           load_base: Callable[[str], tuple[dict[str, torch.Tensor], dict[str, str]]]
           ) -> dict[str, torch.Tensor]:
    """A blob's tensors in blob keys: a delta blob's weights rebuilt from its key frame
    (``load_base(digest)`` gives the key frame's verified tensors and metadata); any other
    blob as it is."""
    if meta.get("encoding") != ENCODING_DELTA:
        return tensors
    where = f"delta blob of group {meta.get('group')!r}"
    base, base_meta = load_base(meta["base"])
    if base_meta.get("encoding") is not None:
        raise CheckpointCorruptError(f"{where}: its key frame {meta['base'][:12]}… is itself "
                                     "encoded; a delta is only ever coded against a plain blob")
    shapes = json.loads(meta["shapes"])
    key = {PARAM + n: high_halves(base[PARAM + n]) for n in shapes if PARAM + n in base}
    if len(key) != len(shapes) or _hi_digest(key, hash_name) != meta.get(f"base_hi_{hash_name}"):
        raise CheckpointCorruptError(
            f"{where}: its key frame {meta['base'][:12]}… is not the one it was coded against; "
            "the run cannot be loaded at this step. `layerwise ckpt verify RUN` lists the "
            "affected steps; load an unaffected one with --step.")
    out = {k: t for k, t in tensors.items() if not k.startswith((LO, HI_CHANGED, HI_NEW))}
    for name, shape in shapes.items():
        hi = key[PARAM + name].copy()
        changed = np.unpackbits(tensors[HI_CHANGED + name].numpy(), count=hi.size,
                                bitorder="little").astype(bool)
        hi[changed] = tensors[HI_NEW + name].numpy().view(np.uint16)
        lo = tensors[LO + name].numpy().view(np.uint16)
        bits = (hi.astype(np.uint32) << 16) | lo
        out[PARAM + name] = torch.from_numpy(bits.view(np.float32)).reshape(shape)
    return out
