"""Run format versions: new runs are the current format (BLAKE3 content addresses; 8-bit moments kept 8-bit from 3, sharded groups from 4); format 1 runs (sha256),
as an older layerwise wrote them (``data/run_v1_sha256``, see ``data/make_run_v1_sha256.py``),
still open, verify, load, and are continued as format 1; corruption is caught under both hashes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import blake3
import hashlib
import pytest
import torch
from safetensors.torch import load_file

from layerwise.ckpt import FORMAT_VERSION, Checkpointer, CheckpointCorruptError, RunDir, open_run_step
from layerwise.ckpt.provider import DictStateProvider

V1_RUN = Path(__file__).with_name("data") / "run_v1_sha256"
GROUPS = ["embed", "layers.0", "layers.1", "norm"]


V1_STATE = load_file(V1_RUN.with_name("run_v1_sha256_state.safetensors"))
"""The state ``data/make_run_v1_sha256.py`` saved, as it saved it: stored beside the run, not
regenerated, because ``torch.randn``'s values depend on the CPU kernel path
(``ATEN_CPU_CAPABILITY``) and the fixture's blobs do not."""


def content(g: str, v: int) -> dict[str, torch.Tensor]:
    """The state of group ``g`` at version ``v`` (1 at step 10, 2 at step 20; 3: embed only)."""
    prefix = f"v{v}/"
    return {k[len(prefix):]: t.clone() for k, t in V1_STATE.items()
            if k.startswith(prefix) and k.endswith((f"/{g}.weight", f"/{g}.bias"))}


def version_at(g: str, saved_step: int) -> int:
    return 1 if g == "norm" else saved_step // 10  # norm never changed after step 10


def zero_provider() -> DictStateProvider:
    return DictStateProvider({g: {k: torch.zeros_like(t) for k, t in content(g, 1).items()}
                              for g in GROUPS})


@pytest.fixture
def v1_run(tmp_path) -> Path:
    run = tmp_path / "v1"
    shutil.copytree(V1_RUN, run)
    return run


def _flip_a_byte(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_format_1_sha256_run_still_opens_verifies_and_loads(v1_run):
    """The fixture was written by layerwise before format 2; it must read as it was written.

    Mutation this fails on (made once, by hand): ``manifest_hash`` returning ``"blake3"`` for
    every manifest (format 1 checksums checked with the new hash: verify faults, loads refuse)."""
    store = RunDir.open(v1_run)
    assert (store.version, store.hash_name) == (1, "sha256")
    rep = store.verify()
    assert rep.ok, rep.faults
    assert rep.steps == [10, 20] and rep.blobs_checked == 5
    rs = open_run_step(v1_run, 20)
    assert {e.hash_name for e in rs.entries.values()} == {"sha256"}
    for g, e in rs.entries.items():
        assert e.digest == hashlib.sha256(e.blob_path.read_bytes()).hexdigest()
        want = content(g, version_at(g, e.saved_step))
        got = rs.load_group(g)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), g
    prov = zero_provider()
    res = Checkpointer(v1_run, provider=prov, async_save=False, tracker_log=False).load()
    assert (res.step, res.extra, res.data_position) == (20, {"v": 2}, 20)
    assert res.stale_groups == {"embed": 10, "layers.1": 10}
    assert torch.equal(prov.state["layers.0"]["param/layers.0.weight"],
                       content("layers.0", 2)["param/layers.0.weight"])


def test_a_corrupted_blob_of_a_format_1_run_is_detected(v1_run):
    rs = open_run_step(v1_run, 20)
    _flip_a_byte(rs.entries["layers.0"].blob_path)
    rep = RunDir.open(v1_run).verify()
    assert any("layers.0" in f and "checksum mismatch (sha256" in f for f in rep.faults), rep.faults
    with pytest.raises(CheckpointCorruptError):
        open_run_step(v1_run, 20).load_group("layers.0")


def test_new_runs_are_the_current_format_named_by_blake3(tmp_path, v1_run):
    """A new run's format.json, manifests and step-file records name BLAKE3, and each blob's
    name and checksum are the BLAKE3 of its bytes (computed here by the ``blake3`` package
    directly). The blob bytes themselves are those format 1 wrote for the same state.

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
    v1 = RunDir.open(v1_run).read_manifest(10)
    assert sorted((run / e["blob"]).read_bytes() for e in m["groups"].values()) == \
        sorted((v1_run / e["blob"]).read_bytes() for e in v1["groups"].values())
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


def test_saving_into_a_format_1_run_continues_it_as_format_1(v1_run):
    """A resumed old run stays readable by the layerwise that wrote it: the new step's manifest
    is format 1 with sha256 checksums, and unchanged groups reuse the old sha256 blobs.

    Mutation this fails on (made once, by hand): ``RunDir.create`` keeping the new format's
    version and hash for an existing run (the new manifest is format 2 in a format 1 run)."""
    prov = zero_provider()
    ck = Checkpointer(v1_run, provider=prov, policy="full", async_save=False, tracker_log=False)
    ck.load()
    for k, t in content("embed", 3).items():
        prov.state["embed"][k].copy_(t)
    rep = ck.save(30, extra={"v": 3})
    ck.close()
    assert json.loads((v1_run / "format.json").read_text())["format_version"] == 1
    store = RunDir.open(v1_run)
    m = store.read_manifest(30)
    assert m["format_version"] == 1 and "hash" not in m
    assert all("sha256" in e and "blake3" not in e for e in m["groups"].values())
    assert all("sha256" in r for r in m["files"].values())
    assert rep.written == ["embed"]  # the rest is the step-20 state: its sha256 blobs are reused
    old = store.read_manifest(20)["groups"]
    assert all(m["groups"][g]["blob"] == old[g]["blob"] for g in GROUPS if g != "embed")
    assert store.verify().ok
    got = open_run_step(v1_run).load_group("embed")
    assert torch.equal(got["param/embed.weight"], content("embed", 3)["param/embed.weight"])


def test_an_unknown_hash_or_a_newer_version_is_refused_clearly(tmp_path, v1_run):
    fmt = v1_run / "format.json"
    newer = FORMAT_VERSION + 1
    fmt.write_text(json.dumps({"format": "layerwise-ckpt", "format_version": newer, "hash": "blake3"}))
    with pytest.raises(ValueError, match=f"format_version {newer}.*Upgrade layerwise"):
        RunDir.open(v1_run)
    fmt.write_text(json.dumps({"format": "layerwise-ckpt", "format_version": 2, "hash": "k12"}))
    with pytest.raises(ValueError, match="content hash 'k12'"):
        RunDir.open(v1_run)
    fmt.write_text(json.dumps({"format": "layerwise-ckpt", "format_version": 2, "hash": "blake3"}))
    path = v1_run / "steps" / f"{20:012d}" / "manifest.json"
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "format_version": 2, "hash": "k12"}))
    with pytest.raises(ValueError, match="content hash 'k12'"):
        RunDir.open(v1_run).read_manifest(20)
