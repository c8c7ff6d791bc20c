"""The safetensors encoding, shared by checkpoint blobs and HF exports, and a streaming writer.

``save_file`` needs the whole shard in memory because the header comes first; here a header
region is reserved, data streams after it, and the real header is written back padded with
spaces (which the format allows)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

DEFAULT_HEADER_RESERVE_BYTES = 64 * 1024
"""Room for the JSON header of one shard: about 500 tensors (a Llama layer has 9)."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (copied to a contiguous CPU tensor only when it is not one)."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.numel() == 0:  # an empty tensor's view as bytes is refused (stride 0)
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def dtype_name(name: str, t: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store") from None


def encode_header(entries: dict[str, dict], metadata: dict[str, str]) -> bytes:
    """The JSON header of a safetensors file (unpadded): metadata first, then tensor entries."""
    return json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()


class ShardedSafetensorsWriter:
    """Write tensors into ``dir/.shard-{i}.tmp`` files; :meth:`finish` names them the HF way."""

    def __init__(
        self,
        out_dir: Path,
        max_shard_bytes: int | None,
        header_reserve_bytes: int = DEFAULT_HEADER_RESERVE_BYTES,
        metadata: dict[str, str] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.header_reserve_bytes = header_reserve_bytes - header_reserve_bytes % 8  # keeps data 8-aligned
        self.metadata = {"format": "pt", **(metadata or {})}
        self._shards: list[Path] = []
        self._entries: list[dict[str, dict]] = []  # per shard: name -> {dtype, shape, data_offsets}
        self._file = None
        self._data_bytes = 0
        self.total_bytes = 0

    def _header(self, entries: dict[str, dict]) -> bytes:
        return encode_header(entries, self.metadata)

    def _open_shard(self) -> None:
        self._close_shard()
        path = self.out_dir / f".shard-{len(self._shards):05d}.tmp"
        self._file = open(path, "wb")
        self._file.seek(8 + self.header_reserve_bytes)
        self._shards.append(path)
        self._entries.append({})
        self._data_bytes = 0

    def _close_shard(self) -> None:
        if self._file is None:
            return
        header = self._header(self._entries[-1])
        assert len(header) <= self.header_reserve_bytes
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self.header_reserve_bytes))
        self._file.write(header + b" " * (self.header_reserve_bytes - len(header)))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        entry = {"dtype": dtype_name(name, tensor), "shape": list(tensor.shape)}
        nbytes = tensor.numel() * tensor.element_size()
        if self._file is not None:
            over_size = self.max_shard_bytes is not None and self._data_bytes + nbytes > self.max_shard_bytes
            probe = {**self._entries[-1], name: {**entry, "data_offsets": [0, 2**62]}}
            over_header = len(self._header(probe)) > self.header_reserve_bytes
            if (over_size and self._data_bytes > 0) or over_header:
                self._open_shard()
        if self._file is None:
            self._open_shard()
        probe = {name: {**entry, "data_offsets": [0, 2**62]}}
        if len(self._header(probe)) > self.header_reserve_bytes:
            raise ValueError(f"tensor name {name!r} is too long for a safetensors header")
        self._file.write(tensor_bytes(tensor))
        self._entries[-1][name] = {**entry, "data_offsets": [self._data_bytes, self._data_bytes + nbytes]}
        self._data_bytes += nbytes
        self.total_bytes += nbytes

    def finish(self, single_name: str, sharded_pattern: str) -> dict[str, str]:
        """Close the last shard, rename shards, return the weight map (tensor name -> file name).

        One shard is named ``single_name``; several are named ``sharded_pattern.format(i, n)``."""
        self._close_shard()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, (tmp, entries) in enumerate(zip(self._shards, self._entries)):
            final = single_name if n == 1 else sharded_pattern.format(i + 1, n)
            os.replace(tmp, self.out_dir / final)
            for name in entries:
                weight_map[name] = final
        return weight_map

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for p in self._shards:
            p.unlink(missing_ok=True)
