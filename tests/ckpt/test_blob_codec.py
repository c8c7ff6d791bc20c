"""Delta-coded blobs (run format 6, ``ckpt.blob_codec``): lossless, resumable, kept by gc."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from layerwise.ckpt import Checkpointer, CheckpointCorruptError, RunDir, open_run_step
from layerwise.ckpt.blob_codec import (HI_CHANGED, HI_NEW, LO, KeyFrame, blob_metadata, decode,
                                       encode_delta, high_halves)
from layerwise.engine.batch import Batch

from test_split_master_ckpt import _engine, _masters

SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFBFFFFF,
                0x00000001, 0x807FFFFF, 0x3F800000, 0x3F80FFFF]
"""±0, ±inf, NaNs with payloads (quiet and signalling), subnormals, 1.0 and its neighbours."""


def _fp32_of_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _group(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.cat([torch.randn(995, generator=g), _fp32_of_bits(SPECIAL_BITS)]).reshape(67, 15)
    return {"param/w": w, "param/b": torch.randn(13, generator=g),
            "param/h": torch.randn(9, generator=g).to(torch.bfloat16),
            "exp_avg/w": torch.randn(67, 15, generator=g), "step/w": torch.tensor(3.0),
            "exp_avg_codes/b": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
            "exp_avg_sq_codes/b": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
            "q8_blocks/b": torch.tensor([256, 3])}


def _moved(t: dict[str, torch.Tensor], every: int) -> dict[str, torch.Tensor]:
    """``t`` with the bit patterns of every ``every``-th fp32 weight changed: in the low half
    only, or also in the high half (every third of those)."""
    out = dict(t)
    for k in ("param/w", "param/b"):
        bits = t[k].reshape(-1).view(torch.int32).clone()
        bits[::every] ^= 0x5A5A
        bits[::3 * every] ^= 0x00A50000
        out[k] = bits.view(torch.float32).reshape(t[k].shape)
    return out


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def test_decode_of_encode_is_bit_identical_for_every_dtype_and_plane():
    """Every tensor of a group (fp32 weights with NaN payloads, ±0, ±inf and subnormals; bf16
    weights; fp32 moments; 8-bit codes; steps) comes back with its dtype, shape and bits.

    Mutation that fails it: ``np.unpackbits(..., bitorder="big")`` in ``decode`` (the bitmap
    read in the other bit order): high halves land on the wrong elements."""
    base = _group(0)
    now = _moved(base, 5)
    key = {k: high_halves(v) for k, v in base.items() if k.startswith("param/") and v.dtype == torch.float32}
    coded = encode_delta(now, key, KeyFrame("blobs/aa/x", "ab" * 32, 1), "blake3")
    assert coded is not None
    tensors, meta = coded
    assert {LO + "w", HI_CHANGED + "w", HI_NEW + "w"} <= tensors.keys() and "param/w" not in tensors
    assert "param/h" in tensors  # bf16 weights are stored as they are
    changed = int((high_halves(now["param/w"]) != key["param/w"]).sum())
    assert tensors[HI_NEW + "w"].numel() == changed > 0
    got = decode(tensors, {**meta, "group": "g"}, "blake3", lambda d: (base, {}))
    assert _same_bits(got, now)


def test_a_delta_refuses_a_key_frame_it_was_not_coded_against():
    """A key frame whose high halves differ from those the delta was coded against fails the
    load, never decodes to other weights.

    Mutation that fails it: dropping the ``base_hi_<hash>`` comparison in ``decode``."""
    base = _group(0)
    key = {k: high_halves(v) for k, v in base.items() if k.startswith("param/") and v.dtype == torch.float32}
    tensors, meta = encode_delta(_moved(base, 5), key, KeyFrame("r", "cd" * 32, 1), "blake3")
    other = _moved(base, 7)
    with pytest.raises(CheckpointCorruptError, match="not the one it was coded against"):
        decode(tensors, meta, "blake3", lambda d: (other, {}))


def test_a_group_whose_high_halves_mostly_changed_is_written_whole():
    """Over ``KEYFRAME_CHANGED_FRACTION`` of the high halves changed: no delta (a key frame)."""
    base = _group(0)
    key = {k: high_halves(v) for k, v in base.items() if k.startswith("param/") and v.dtype == torch.float32}
    most = {**base, "param/w": -base["param/w"], "param/b": -base["param/b"]}  # every sign flipped
    assert encode_delta(most, key, KeyFrame("r", "ef" * 32, 1), "blake3") is None


def _batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (2, 11), generator=g) for _ in range(n)]
    return [Batch(i[:, :-1], i[:, 1:]) for i in ids]


LR = 2e-5
"""Small enough that a save's high halves mostly stay (deltas are written), as in a fine-tune."""


def _train_and_save(root, encoding: str, batches: list[Batch]) -> tuple[dict, dict]:
    """Six steps of the production store (split master, bf16 copies, 8-bit moments), a parity
    save after each: the masters at each step, and the manifests."""
    engine, provider = _engine(True, 0)
    masters, manifests = {}, {}
    with Checkpointer(root, provider=provider, policy="parity", encoding=encoding) as ck:
        for step, b in enumerate(batches, 1):
            engine.train_step([b], lr=LR)
            engine.synchronize()
            masters[step] = _masters(engine.store)
            ck.save(step)
            ck.wait()
    for step in masters:
        manifests[step] = RunDir.open(root).read_manifest(step)
    engine.close()
    return masters, manifests


def test_resume_from_a_delta_coded_composite_equals_resume_from_the_plain_one(tmp_path):
    """Saved with ``encoding="delta"`` and with ``"plain"`` (parity: composites of two saves),
    loaded into fresh split stores at step 5: the same fp32 masters (remainders included), and
    the next step's loss and masters the same. Fewer bytes for the delta run.

    Mutation that fails it: ``_key_frame`` taking the committed entry's blob even when that
    entry is itself a delta (``rec = prev``): a delta coded against a delta, refused on load."""
    batches = _batches(7)
    plain, plain_m = _train_and_save(tmp_path / "plain", "plain", batches[:6])
    delta, delta_m = _train_and_save(tmp_path / "delta", "delta", batches[:6])
    assert all(torch.equal(plain[s], delta[s]) for s in plain)  # same training either way
    assert any("base" in e for m in delta_m.values() for e in m["groups"].values()), "no delta written"
    two, four = delta_m[2]["groups"], delta_m[4]["groups"]
    assert any("base" in two[g] and four[g].get("base") == two[g]["base"]
               and four[g]["saved_step"] == 4 for g in two), "no delta after a delta"
    assert sum(m["bytes_written"] for m in delta_m.values()) < sum(
        m["bytes_written"] for m in plain_m.values())

    resumed = []
    for run in ("plain", "delta"):
        engine, provider = _engine(True, 123)
        assert Checkpointer(tmp_path / run, provider=provider).load(5).step == 5
        start = _masters(engine.store)
        loss = engine.train_step([batches[6]], lr=LR).loss
        engine.synchronize()
        resumed.append((start, loss, _masters(engine.store)))
        engine.close()
    (s0, l0, m0), (s1, l1, m1) = resumed
    assert torch.equal(s0, s1) and l0 == l1 and torch.equal(m0, m1)


def test_gc_keeps_a_deltas_key_frame_and_verify_names_a_missing_one(tmp_path):
    """``gc --keep 1`` keeps the key frames the kept step's deltas need (they still load);
    a key frame deleted by hand is a fault of every step that needs it.

    Mutation that fails it: ``entry_blobs`` without the entry's ``base``: gc removes the key
    frame and the kept step no longer loads."""
    _, manifests = _train_and_save(tmp_path / "run", "delta", _batches(4))
    run = RunDir.open(tmp_path / "run")
    run.gc(keep=1)
    rs = open_run_step(tmp_path / "run", 4)
    for g in rs.groups():
        rs.load_group(g)
    bases = {e["base"]["blob"] for e in rs.manifest["groups"].values() if "base" in e}
    assert bases, "step 4 holds no delta"
    meta = blob_metadata((tmp_path / "run" / next(e["blob"] for e in rs.manifest["groups"].values()
                                                  if "base" in e)).read_bytes())
    assert meta["encoding"] == "hi-delta" and json.loads(meta["shapes"])
    (tmp_path / "run" / sorted(bases)[0]).unlink()
    rep = run.verify()
    assert not rep.ok and any(sorted(bases)[0] in f for f in rep.faults)
    with pytest.raises(CheckpointCorruptError, match="missing"):
        for g in rs.groups():
            rs.load_group(g)


def test_an_unknown_encoding_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="encoding='zip' is not one of"):
        Checkpointer(tmp_path / "run", torch.nn.Linear(2, 2), encoding="zip")


def test_moments8_stores_fp32_moments_8bit_and_a_resume_reads_them_back_within_the_bound(tmp_path):
    """``encoding="delta+moments8"`` on a plain module + torch AdamW: the blob holds 8-bit codes
    (no fp32 moments), the weights load bit for bit and the moments within the quantiser's
    bound (``quant``: about ``sqrt(|x| * scale) / 127``, here at most 2% of the block's max).

    Mutation that fails it: ``moments_8bit`` returning ``tensors`` unchanged (nothing lossy is
    stored: the blob still holds ``exp_avg/``)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(3):
        m(torch.randn(4, 48)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with Checkpointer(tmp_path / "run", m, opt, policy="full", encoding="delta+moments8") as ck:
        ck.save(3)
    rs = open_run_step(tmp_path / "run")
    blob = RunDir.open(tmp_path / "run").root / rs.manifest["groups"]["0"]["blob"]
    keys = set(load_file(str(blob)))
    assert "exp_avg_codes/0.weight" in keys and "exp_avg/0.weight" not in keys
    m2 = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Linear(40, 8))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    Checkpointer(tmp_path / "run", m2, opt2).load()
    for p, p2 in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, p2)
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][k], opt2.state[p2][k]
            assert not torch.equal(a, b) or a.abs().max() == 0  # lossy indeed
            assert (a - b).abs().max() <= 0.02 * a.abs().max() + 1e-30
