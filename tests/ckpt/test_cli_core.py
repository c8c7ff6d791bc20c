"""``layerwise ckpt ls/show/verify/gc`` through the real command-line entry point."""

from __future__ import annotations

import json

from layerwise.cli import main
from layerwise.ckpt import Checkpointer, open_run_step

from test_core_helpers import make_training, train_step


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _make_run(path, policy="parity", steps=4):
    model, opt, sched = make_training()
    with Checkpointer(path, model, opt, sched, policy=policy) as ck:
        for s in range(steps):
            train_step(model, opt, sched)
            ck.save(s * 10)
    return path


def test_ls_show_verify_gc(tmp_path, capsys):
    run = str(_make_run(tmp_path / "run"))
    code, out = _run(capsys, "ckpt", "ls", run, "--json")
    ls = json.loads(out)
    assert code == 0 and [r["step"] for r in ls["steps"]] == [0, 10, 20, 30] and ls["latest"] == 30
    assert ls["steps"][0]["groups_written"] == 7 and ls["steps"][1]["groups_written"] < 7
    assert all(r["policy"] == "parity" for r in ls["steps"])
    assert ls["steps"][1]["bytes_written"] < ls["steps"][0]["bytes_written"]

    code, out = _run(capsys, "ckpt", "show", run, "--step", "25", "--json")
    show = json.loads(out)
    assert code == 0 and show["step"] == 20 and show["requested_step"] == 25
    by = {g["group"]: g for g in show["groups"]}
    assert set(by) == {"embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"}
    assert {g["staleness_checkpoints"] for g in show["groups"]} == {0, 1}
    assert all(g["staleness_steps"] in (0, 10) for g in show["groups"])
    assert show["older_groups"] == {g: 10 for g, e in by.items() if e["saved_step"] == 10} != {}
    code, text = _run(capsys, "ckpt", "show", run)
    assert code == 0 and "layers.3" in text and "step 30" in text
    assert "step 30 is a composite: " in text.splitlines()[-1]

    code, out = _run(capsys, "ckpt", "verify", run, "--json")
    assert code == 0 and json.loads(out)["ok"] is True

    code, out = _run(capsys, "ckpt", "gc", run, "--keep", "1", "--json")
    gc = json.loads(out)
    assert code == 0 and gc["kept_steps"] == [30] and gc["dropped_steps"] == [0, 10, 20]
    code, out = _run(capsys, "ckpt", "verify", run, "--json")
    assert code == 0 and json.loads(out)["ok"]
    rs = open_run_step(run)
    for g in rs.groups():  # the kept step still has every blob it needs (some from step 20)
        rs.load_group(g)


def test_verify_fails_on_corruption_and_missing_blob(tmp_path, capsys):
    run = _make_run(tmp_path / "run", policy="full", steps=2)
    rs = open_run_step(run)
    blob = rs.entries["norm"].blob_path
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    code, out = _run(capsys, "ckpt", "verify", str(run), "--json")
    rep = json.loads(out)
    assert code == 1 and not rep["ok"] and any("norm" in f for f in rep["faults"])
    rs.entries["embed"].blob_path.unlink()
    code, text = _run(capsys, "ckpt", "verify", str(run))
    assert code == 1 and "FAULTY" in text and "missing" in text


def test_cli_user_errors(tmp_path, capsys):
    assert main(["ckpt", "ls", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = _make_run(tmp_path / "run", steps=1)
    assert main(["ckpt", "gc", str(run), "--keep", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["ckpt", "show", str(run), "--step", "-5"]) == 2


def test_merge_of_a_blended_step_names_its_older_groups(tmp_path, capsys):
    """A selective policy's "step N" holds some groups' older versions: ``ckpt merge`` says
    which, from what step (it used to say only "wrote hf checkpoint of step N"); a full save's
    merge has no such note."""
    run = str(_make_run(tmp_path / "run"))
    code, out = _run(capsys, "ckpt", "merge", run, "--out", str(tmp_path / "hf"))
    note = next(line for line in out.splitlines() if "is a composite" in line)
    assert code == 0 and "step 30 is a composite: " in note and " @ 20" in note
    full = str(_make_run(tmp_path / "full", policy="full"))
    code, out = _run(capsys, "ckpt", "merge", full, "--out", str(tmp_path / "hf2"))
    assert code == 0 and "is a composite" not in out
