"""Crash safety: a save stopped at every durability-relevant call (kill and power cut), out of
space, failed writes.

The stop-at-every-call machinery is ``powercut.py`` (next to this file): a driver subprocess
imports torch once and forks one child per stop. Out-of-space children are forked from the test
process.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layerwise
from layerwise.ckpt import Checkpointer, CheckpointWriteError, RunDir, open_run_step
from layerwise.ckpt.provider import DictStateProvider
from powercut import MUTANTS, SCENARIOS, allowed_labels

# ----- a save stopped at every call ---------------------------------------------------------

POWERCUT = Path(__file__).with_name("powercut.py")


MUTANT_SPECS = [f"{scenario}:{mutant}" for mutant in MUTANTS for scenario in ("first", "next")]


def _powercut(work: Path, *specs: str) -> dict[str, dict]:
    """Run the powercut driver; its report per spec (``scenario`` or ``scenario:mutant``)."""
    env = dict(os.environ)
    src = str(Path(layerwise.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(POWERCUT), str(work), *specs], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def powercut(tmp_path_factory) -> dict[str, dict]:
    """Every scenario stopped at every call, and the mutants (one driver run, one torch import,
    shared by the tests below)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the power-cut model reads fsynced files through /proc/self/fd")
    return _powercut(tmp_path_factory.mktemp("powercut"), *SCENARIOS, *MUTANT_SPECS)


def _violations(scenario: str, results: list[dict]) -> list[str]:
    sc, out = SCENARIOS[scenario], []
    for r in results:
        allowed = allowed_labels(sc, r["performed"], r["stopped"])
        for state in ("kill", "power"):
            got = r[state]
            if got.get("error") or got["faults"] or got["loaded"] not in allowed:
                out.append(f"stop at call {r['n']} ({r['stopped']}), {state} state: {got}; "
                           f"may load {sorted(allowed)}")
    return out


def _order_problems(trace: list[list], step: int) -> list[str]:
    """What in ``trace`` (one uninterrupted save) breaks the commit protocol's order."""
    step_dir = f"steps/{step:012d}"
    manifest = f"{step_dir}/manifest.json"
    calls = [(i, *c) for i, c in enumerate(trace)]

    def first(kind, a=None, b=None, after=-1, before=len(trace)):
        return next((i for i, k, x, y in calls if after < i < before and k == kind
                     and (a is None or x == a) and (b is None or y == b)), None)

    def last(kind, a):
        return max((i for i, k, x, _ in calls if k == kind and x == a), default=-1)

    problems = []
    renames = [(i, x, y) for i, k, x, y in calls if k == "replace"]
    [(m_at, m_tmp, _)] = [r for r in renames if r[2] == manifest]
    m_write = first("write", m_tmp)
    # Every file is fsynced after its last write and before it is renamed into place; then its
    # directory is fsynced. Blobs and the step's other files are durable before the manifest.
    for at, tmp, final in renames:
        synced = first("fsync", tmp, after=last("write", tmp), before=at)
        if synced is None:
            problems.append(f"{final} renamed into place before {tmp} was fsynced")
        dir_synced = first("fsync-dir", os.path.dirname(final) or ".", after=at)
        if dir_synced is None:
            problems.append(f"{final}: its directory is never fsynced after the rename")
        if final != manifest and final.startswith(("blobs/", step_dir)) and at < m_at:
            if dir_synced is None or not dir_synced < m_write:
                problems.append(f"{final} is not durable before the manifest is written")
    for i, k, x, _ in calls:
        if k == "mkdir" and x.startswith("blobs/"):
            synced = first("fsync-dir", "blobs", after=i)
            if synced is None or not synced < m_write:
                problems.append(f"new directory {x} is not durable before the manifest is written")
        if i > m_write and (x.startswith(("blobs/", "tmp/blob-"))):
            problems.append(f"blob call {k} {x} after the manifest's write began")
    # A re-saved step is uncommitted durably before any of its files is replaced.
    unlinked = first("unlink", manifest)
    if unlinked is not None:
        synced = first("fsync-dir", step_dir, after=unlinked)
        touched = min(i for i, k, x, _ in calls if i > unlinked and k == "replace"
                      and x.startswith(step_dir))
        if synced is None or not synced < touched:
            problems.append("a re-saved step's files are replaced before its old manifest is "
                            "durably removed")
    # The manifest: written, fsynced, renamed, its directories fsynced; only then ``latest``.
    m_sync = first("fsync", m_tmp, after=last("write", m_tmp), before=m_at)
    dir_synced = first("fsync-dir", step_dir, after=m_at)
    steps_synced = first("fsync-dir", "steps", after=dir_synced if dir_synced is not None else m_at)
    latest = [r for r in renames if r[2] == "latest" and r[0] > m_at]
    chain = [m_write, m_sync, m_at, dir_synced, steps_synced]
    if latest:
        at, tmp, _ = latest[0]
        chain += [first("write", tmp), first("fsync", tmp, before=at), at,
                  first("fsync-dir", ".", after=at)]
    else:
        problems.append("latest is not updated after the manifest")
    if None in chain or chain != sorted(chain):
        problems.append("manifest write, fsync, rename, step dir fsync, steps/ fsync, latest "
                        f"write, fsync, rename, run dir fsync are out of order: calls {chain}")
    return problems


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_save_makes_everything_durable_before_what_names_it(powercut, scenario):
    """(a) The recorded calls of a whole save are in the commit protocol's order: blob write →
    blob fsync → rename → blob directory fsync → (step files likewise) → manifest write + fsync
    → manifest rename → step directory and ``steps/`` fsync → ``latest`` write, fsync, rename,
    run directory fsync.

    Mutations this fails on (each made once, by hand): ``os.fsync`` a no-op in
    ``util/atomic.py`` and ``ckpt/blob_store.py`` (no fsync recorded at all); ``BlobBatch.finish``
    moved after ``commit_step`` in ``SaveWriter.run`` (the manifest renamed before the blobs
    and their directories are fsynced); the blob file fsync removed from ``BlobBatch.submit``;
    ``commit``'s ``fsync_dir(steps/)`` removed."""
    rep = powercut[scenario]
    assert _order_problems(rep["trace"], SCENARIOS[scenario].step) == []


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_stop_at_every_call_leaves_the_last_commit_loadable(powercut, scenario):
    """(b) A save stopped before its Nth call, for every N (and right after it returned): the
    directory as the killed process left it, and what a power cut then leaves (only fsynced
    bytes and directory entries survive, see ``powercut.py``), both open, ``verify`` clean, and
    the newest commit loads bit-exactly (weights, moments, data position): the one before the
    save until the new manifest is renamed into place, the new one once the rename and the
    directory fsyncs after it are done, either in between. ``first``: the first save of a run;
    ``next``: a save after a load (an unchanged group hashed, not rewritten); ``resave``: a step
    saved again (uncommitted first).

    Mutations this fails on (each made once, by hand): ``os.fsync`` a no-op in
    ``util/atomic.py`` and ``ckpt/blob_store.py`` (power state after the save returned: the step
    is gone); ``BlobBatch.finish`` moved after ``commit_step`` in ``SaveWriter.run``, i.e. the
    manifest renamed before the blobs are fsynced (the manifest names missing blobs); the blob
    file fsync removed from ``BlobBatch.submit`` (power state: empty blobs); ``commit``'s
    ``fsync_dir(steps/)`` removed (``first``, ``next``: a power cut after the save returned
    loses the new step directory); ``uncommit`` removing the manifest before moving ``latest``
    (``resave``, kill state: ``latest`` names a step without a manifest, a ``verify`` fault;
    this was the code before this test existed)."""
    rep = powercut[scenario]
    results = rep["results"]
    assert [r["n"] for r in results] == list(range(1, rep["calls"] + 2))
    for r in results:  # every child really stopped at call n (the call count is stable)
        assert len(r["performed"]) == r["n"] - 1, r["n"]
        assert (r["stopped"] == "returned") == (r["n"] == rep["calls"] + 1)
    assert _violations(scenario, results) == []
    loaded = {r[s]["loaded"] for r in results for s in ("kill", "power")}
    assert {"old", "new"} <= loaded, "the stops never straddled the commit"


@pytest.mark.parametrize("spec", MUTANT_SPECS)
def test_power_cut_model_catches_a_broken_save(powercut, spec):
    """The checks above can fail, where a kill-only test could not: a save broken on purpose
    inside the child (``powercut.MUTANTS``) is stopped from its end backwards until a state
    breaks a rule. ``fsync-noop``: ``os.fsync`` has no effect, so a power cut after the save
    returned loses the step. ``manifest-before-blob-fsync``: ``BlobBatch.finish`` (blob fsyncs,
    blob directory fsyncs) runs after ``RunDir.commit``, so a power cut right after the commit
    leaves a manifest naming missing blobs. In both, every kill state is fine."""
    scenario = spec.partition(":")[0]
    bad = _violations(scenario, powercut[spec]["results"])
    assert bad, f"{spec} went unnoticed"
    assert all(", power state:" in b for b in bad), bad  # a kill never shows it


GROUPS = ["embed", "layers.0", "layers.1", "layers.2", "frozen", "norm"]
NUMEL = 16 * 1024  # 64 KiB of weights per group, plus two moments


def content(group: str, step: int) -> dict[str, torch.Tensor]:
    gi = GROUPS.index(group)
    v = float(gi) if group == "frozen" else float(step * 10 + gi)
    return {
        f"param/{group}.weight": torch.full((NUMEL,), v),
        f"exp_avg/{group}.weight": torch.full((NUMEL,), v + 0.5),
        f"exp_avg_sq/{group}.weight": torch.full((NUMEL,), v + 0.25),
        f"step/{group}.weight": torch.tensor(float(step)),
    }


def provider_at(step: int) -> DictStateProvider:
    return DictStateProvider({g: content(g, step) for g in GROUPS})


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            fn(*args)
        except BaseException as e:  # report, never return into pytest
            code = 3
            try:
                with open(os.environ.get("CKPT_CHILD_ERR", "/dev/null"), "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
            except OSError:
                pass
        os._exit(code)
    return pid


def _check_loaded(run) -> int:
    prov = DictStateProvider({g: {k: torch.zeros_like(t) for k, t in content(g, 0).items()} for g in GROUPS})
    res = Checkpointer(run, provider=prov, tracker_log=False).load()
    rs = open_run_step(run, res.step)
    assert res.extra == {"step": res.step}
    for g in GROUPS:
        saved = rs.entries[g].saved_step
        assert saved <= res.step
        for k, want in content(g, saved).items():
            assert torch.equal(prov.state[g][k], want), (g, k, saved)
    return res.step


def _child_out_of_space(run) -> None:
    prov = provider_at(1)
    ck = Checkpointer(run, provider=prov, policy="full", async_save=True)
    ck.save(1, extra={"step": 1})
    ck.wait()
    limit = NUMEL * 4  # each blob is ~3x this: the next blob write hits the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    for g in GROUPS:
        for k, t in content(g, 2).items():
            prov.state[g][k].copy_(t)
    ck.save(2, extra={"step": 2})
    ck.wait()  # raises CheckpointWriteError


def test_out_of_space_fails_clearly_and_keeps_previous(tmp_path, monkeypatch):
    run, err = tmp_path / "run", tmp_path / "err.txt"
    monkeypatch.setenv("CKPT_CHILD_ERR", str(err))
    pid = _fork(_child_out_of_space, run)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3
    msg = err.read_text()
    assert msg.startswith(CheckpointWriteError.__name__)
    assert "file size limit" in msg and "previous committed checkpoint is intact" in msg
    store = RunDir.open(run)
    assert store.committed_steps() == [1] and store.verify().ok
    assert not any((run / "tmp").iterdir()), "a failed write left a temp file behind"
    assert _check_loaded(run) == 1


def test_failed_save_rolls_back_and_next_save_is_complete(tmp_path, monkeypatch):
    """In-process: a write error surfaces at wait(); the next save still writes what it must."""
    run = tmp_path / "run"
    prov = provider_at(1)
    ck = Checkpointer(run, provider=prov, policy="filter", threshold=0.0, async_save=True)
    ck.save(1, extra={"step": 1})
    ck.wait()
    for g in GROUPS:
        for k, t in content(g, 2).items():
            prov.state[g][k].copy_(t)
    import layerwise.ckpt.blob_store as ls

    real = ls._write_payload
    monkeypatch.setattr(ls, "_write_payload", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space")))
    ck.save(2, extra={"step": 2})
    try:
        ck.wait()
        raise AssertionError("expected CheckpointWriteError")
    except CheckpointWriteError as e:
        assert "disk is full" in str(e)
    monkeypatch.setattr(ls, "_write_payload", real)
    rep = ck.save(3, extra={"step": 3})
    ck.wait()
    # Step 2 never committed, so everything that changed since step 1 is written at step 3.
    assert set(rep.written) == set(GROUPS) - {"frozen"}
    assert RunDir.open(run).committed_steps() == [1, 3]
