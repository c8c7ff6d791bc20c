"""The run format: new runs are the one current format (BLAKE3 content addresses), corruption
is caught, and a run of any other format version, or another hash, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
import torch

from layerwise.ckpt import FORMAT_VERSION, Checkpointer, CheckpointCorruptError, RunDir, open_run_step
from layerwise.ckpt.provider import DictStateProvider

GROUPS = ["embed", "layers.0", "layers.1", "norm"]


def content(g: str, v: int) -> dict[str, torch.Tensor]:
    """The state of group ``g`` at version ``v``."""
    gen = torch.Generator().manual_seed(7 + 31 * v + len(g))
    return {f"param/{g}.weight": torch.randn(16, 8, generator=gen),
            f"param/{g}.bias": torch.randn(8, generator=gen).to(torch.bfloat16),
            f"exp_avg/{g}.weight": torch.randn(16, 8, generator=gen),
            f"exp_avg_sq/{g}.weight": torch.rand(16, 8, generator=gen),
            f"step/{g}.weight": torch.tensor(float(v))}


def _flip_a_byte(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def saved_run(tmp_path) -> Path:
    run = tmp_path / "run"
    prov = DictStateProvider({g: content(g, 1) for g in GROUPS})
    with Checkpointer(run, provider=prov, policy="full", async_save=False, tracker_log=False) as ck:
        ck.save(10, extra={"v": 1}, data_position=10)
    return run


def test_new_runs_are_the_current_format_named_by_blake3(tmp_path):
    """A new run's format.json, manifests and step-file records name BLAKE3, and each blob's
    name and checksum are the BLAKE3 of its bytes (computed here by the ``blake3`` package
    directly).

    Mutation this fails on (made once, by hand): ``HASHES["blake3"]`` made ``hashlib.sha256``
    (names and checksums are then not BLAKE3 digests)."""
    run = tmp_path / "v2"
    prov = DictStateProvider({g: content(g, 1) for g in GROUPS})
    with Checkpointer(run, provider=prov, policy="full", async_save=False, tracker_log=False) as ck:
        ck.save(10, extra={"v": 1}, data_position=10)
    assert json.loads((run / "format.json").read_text()) == {
        "format": "layerwise-ckpt", "format_version": FORMAT_VERSION, "hash": "blake3"}
    m = RunDir.open(run).read_manifest(10)
    assert (m["format_version"], m["hash"]) == (FORMAT_VERSION, "blake3")
    for e in m["groups"].values():
        data = (run / e["blob"]).read_bytes()
        assert "sha256" not in e and e["blake3"] == blake3.blake3(data).hexdigest()
        assert e["blob"] == f"blobs/{e['blake3'][:2]}/{e['blake3']}.safetensors"
    for name, rec in m["files"].items():
        assert rec["blake3"] == blake3.blake3((run / "steps" / f"{10:012d}" / name).read_bytes()).hexdigest()
    assert RunDir.open(run).verify().ok


def test_a_corrupted_blob_or_step_file_is_detected_under_blake3(tmp_path):
    """One flipped bit in a blob (same size) or in ``state.json`` fails ``verify`` and the load.

    Mutation this fails on (made once, by hand): ``load_blob`` comparing only the size (the
    digest check dropped): the corrupt group loads."""
    run = tmp_path / "v2"
    prov = DictStateProvider({g: content(g, 1) for g in GROUPS})
    with Checkpointer(run, provider=prov, policy="full", async_save=False, tracker_log=False) as ck:
        ck.save(10, extra={"v": 1})
    rs = open_run_step(run)
    _flip_a_byte(rs.entries["layers.1"].blob_path)
    rep = RunDir.open(run).verify()
    assert any("layers.1" in f and "checksum mismatch (blake3" in f for f in rep.faults), rep.faults
    with pytest.raises(CheckpointCorruptError):
        open_run_step(run).load_group("layers.1")
    open_run_step(run).load_group("layers.0")  # the others are fine
    _flip_a_byte(run / "steps" / f"{10:012d}" / "state.json", at=5)
    assert any("state.json checksum mismatch" in f for f in RunDir.open(run).verify().faults)
    with pytest.raises(CheckpointCorruptError):
        open_run_step(run).state()


def test_a_run_of_another_format_version_or_hash_is_refused_in_one_line(tmp_path):
    """format.json of an older or a newer version, and a manifest of another version, are
    refused in one line that says the version, the one read and what to do; another content
    hash is refused too.

    Mutation seen failing: accepting version 5 (``refuse_version`` letting it through)."""
    run = saved_run(tmp_path)
    fmt = run / "format.json"
    for version in (1, FORMAT_VERSION - 1, FORMAT_VERSION + 1):
        fmt.write_text(json.dumps({"format": "layerwise-ckpt", "format_version": version, "hash": "blake3"}))
        with pytest.raises(ValueError) as err:
            RunDir.open(run)
        msg = str(err.value)
        assert "\n" not in msg
        assert (f"checkpoint run format_version {version}; this layerwise reads {FORMAT_VERSION}: "
                "start the run again or use a layerwise that wrote it") in msg, msg
    fmt.write_text(json.dumps({"format": "layerwise-ckpt", "format_version": FORMAT_VERSION, "hash": "sha256"}))
    with pytest.raises(ValueError, match="content hash 'sha256'"):
        RunDir.open(run)
    fmt.write_text(json.dumps({"format": "layerwise-ckpt", "format_version": FORMAT_VERSION, "hash": "blake3"}))
    path = run / "steps" / f"{10:012d}" / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "format_version": 2}))
    with pytest.raises(ValueError, match=f"format_version 2; this layerwise reads {FORMAT_VERSION}"):
        RunDir.open(run).read_manifest(10)
    path.write_text(json.dumps({**m, "hash": "k12"}))
    with pytest.raises(ValueError, match="content hash 'k12'"):
        RunDir.open(run).read_manifest(10)
