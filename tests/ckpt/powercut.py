"""Stop a checkpoint save at every durability-relevant call; simulate a kill and a power cut.

Used by ``test_crash_core.py``. A save's calls under the run directory are recorded and counted:
file writes (``os.write``, and ``write`` on files from ``os.fdopen``), ``os.fsync`` of files and of
directories, ``os.replace`` / ``os.rename``, ``os.unlink`` / ``os.remove`` of an existing path,
``os.mkdir`` of a new directory and ``os.rmdir``. A child forked from the driver makes one save and
``os._exit``s *instead of* making its Nth call (N = calls + 1: right after ``wait()`` returned).
Two states of the run directory are then checked:

- **kill**: the directory as the dead process left it (a kill ends the process, not the page
  cache: everything written is there, synced or not);
- **power**: what a power cut at that moment may leave, modelled pessimistically. A file's bytes
  are what they were at its last ``fsync`` (none if it was never fsynced); a directory's entries
  are what they were at its last ``fsync`` (its entries when the save began, for a directory that
  existed then; none for one created since). The child keeps what it needs as it goes: a copy of
  a file's bytes at each fsync, the listing of a directory at each fsync. Calls are not passed to
  the real ``fsync`` (the model, not the disk, decides what survives).

Run as a script this is the driver (torch imported once, one fork per N; the specs shared out
over up to 4 workers forked from it, one per core)::

    python powercut.py WORKDIR SCENARIO[:MUTANT] ...

It prints one JSON object: per spec the reference trace of an uninterrupted save and, per N,
the call it stopped at and what the kill and power states load. A mutant (``MUTANTS``) breaks
the save on purpose; then N runs from the end down and stops at the first state that breaks a
rule (``allowed_labels``), to show that the checks can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

# ----- the recorder (runs in the forked child) ----------------------------------------------

HOOKED = ("open", "close", "write", "fsync", "replace", "rename", "unlink", "remove", "mkdir",
          "rmdir", "fdopen")
_REAL = {name: getattr(os, name) for name in (*HOOKED, "_exit")}


class DiskRecorder:
    """Counts and records the calls of one process under ``root``, keeps what a power cut would
    leave, and stops the process at call ``stop_at`` (before making it)."""

    def __init__(self, root: Path, side: Path, dump: Path, stop_at: int | None,
                 fsync_has_effect: bool = True):
        self.root = os.path.abspath(root)
        self.side = Path(side)
        self.dump = Path(dump)
        self.stop_at = stop_at
        self.fsync_has_effect = fsync_has_effect
        self.lock = threading.RLock()
        self.calls = 0
        self.trace: list[list] = []
        """Calls made: ``[kind, path, path2]``, paths relative to ``root``."""
        self.fds: dict[int, tuple[str, int]] = {}  # fd -> (path, inode), for fds opened under root
        self.gen_of_inode: dict[int, int] = {}  # inode -> file generation (inodes get reused)
        self.next_gen = 0
        self.durable_dirs: dict[str, dict[str, list]] = {}
        """Per directory: its entries at its last fsync, ``name -> ["d", None] | ["f", gen]``."""

    # ----- bookkeeping ------------------------------------------------------------------

    def _rel(self, path) -> str | None:
        p = os.path.abspath(os.fspath(path))
        if p == self.root:
            return "."
        if p.startswith(self.root + os.sep):
            return p[len(self.root) + 1:]
        return None

    def _abs(self, rel: str) -> str:
        return self.root if rel == "." else os.path.join(self.root, rel)

    def _gen(self, inode: int, new: bool = False) -> int:
        if new or inode not in self.gen_of_inode:
            self.gen_of_inode[inode] = self.next_gen
            self.next_gen += 1
        return self.gen_of_inode[inode]

    def _keep_dir(self, rel: str) -> None:
        path = self._abs(rel)
        entries = {}
        for name in sorted(os.listdir(path)):
            st = os.lstat(os.path.join(path, name))
            entries[name] = ["d", None] if stat.S_ISDIR(st.st_mode) else ["f", self._gen(st.st_ino)]
        self.durable_dirs[rel] = entries

    def _keep_file(self, source: str, inode: int) -> None:
        with open(source, "rb") as src, open(self.side / str(self._gen(inode)), "wb") as dst:
            shutil.copyfileobj(src, dst)

    def _fd(self, fd: int) -> str | None:
        """The path (under root) ``fd`` was opened as, if it still refers to that file."""
        ent = self.fds.get(fd)
        if ent is None:
            return None
        try:
            if os.fstat(fd).st_ino == ent[1]:
                return ent[0]
        except OSError:
            pass
        del self.fds[fd]
        return None

    def _call(self, kind: str, a: str | None, b: str | None = None) -> None:
        """One counted call; the process ends instead of making call ``stop_at``."""
        self.calls += 1
        if self.calls == self.stop_at:
            self.finish(stopped=[kind, a, b])
        self.trace.append([kind, a, b])

    # ----- start and end ----------------------------------------------------------------

    def start(self) -> None:
        """Everything under root is durable now; install the hooks."""
        self.side.mkdir(parents=True, exist_ok=True)
        for dirpath, _dirs, files in os.walk(self.root):
            rel = self._rel(dirpath)
            self._keep_dir(rel)
            for name in files:
                p = os.path.join(dirpath, name)
                self._keep_file(p, os.lstat(p).st_ino)
        for name in HOOKED:
            setattr(os, name, getattr(self, "_" + name))

    def finish(self, stopped: list | str) -> None:
        """Write what the driver needs and end the process (no cleanup runs, like a kill)."""
        with open(self.dump, "w") as f:
            json.dump({"calls": len(self.trace), "stopped": stopped, "trace": self.trace,
                       "durable_dirs": self.durable_dirs}, f)
        _REAL["_exit"](0)

    # ----- hooks ------------------------------------------------------------------------

    def _open(self, path, flags, mode=0o777, *, dir_fd=None):
        rel = self._rel(path) if dir_fd is None else None
        if rel is None:
            return _REAL["open"](path, flags, mode, dir_fd=dir_fd)
        with self.lock:
            existed = os.path.lexists(path)
            fd = _REAL["open"](path, flags, mode)
            inode = os.fstat(fd).st_ino
            if not existed:
                self._gen(inode, new=True)
            self.fds[fd] = (rel, inode)
            return fd

    def _close(self, fd):
        self.fds.pop(fd, None)
        return _REAL["close"](fd)

    def _write(self, fd, data):
        rel = self._fd(fd)
        if rel is None:
            return _REAL["write"](fd, data)
        with self.lock:
            self._call("write", rel)
            return _REAL["write"](fd, data)

    def _fsync(self, fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        rel = self._fd(fd)
        if rel is None:
            return _REAL["fsync"](fd)
        with self.lock:
            st = os.fstat(fd)
            is_dir = stat.S_ISDIR(st.st_mode)
            self._call("fsync-dir" if is_dir else "fsync", rel)
            if not self.fsync_has_effect:
                return None
            if is_dir:
                self._keep_dir(rel)
            else:
                self._keep_file(f"/proc/self/fd/{fd}", st.st_ino)
            return None

    def _move(self, kind, src, dst, **kw):
        a, b = self._rel(src), self._rel(dst)
        if (a is None and b is None) or kw:
            return _REAL[kind](src, dst, **kw)
        with self.lock:
            self._call("replace", a, b)
            return _REAL[kind](src, dst)

    def _replace(self, src, dst, **kw):
        return self._move("replace", src, dst, **kw)

    def _rename(self, src, dst, **kw):
        return self._move("rename", src, dst, **kw)

    def _remove_path(self, kind, path, **kw):
        rel = self._rel(path)
        if rel is None or kw or not os.path.lexists(path):
            return _REAL[kind](path, **kw)
        with self.lock:
            self._call("unlink" if kind != "rmdir" else "rmdir", rel)
            return _REAL[kind](path)

    def _unlink(self, path, **kw):
        return self._remove_path("unlink", path, **kw)

    def _remove(self, path, **kw):
        return self._remove_path("remove", path, **kw)

    def _rmdir(self, path, **kw):
        return self._remove_path("rmdir", path, **kw)

    def _mkdir(self, path, mode=0o777, **kw):
        rel = self._rel(path)
        if rel is None or kw or os.path.lexists(path):
            return _REAL["mkdir"](path, mode, **kw)
        with self.lock:
            self._call("mkdir", rel)
            _REAL["mkdir"](path, mode)
            self.durable_dirs.pop(rel, None)  # a new directory: no entry of it is durable yet

    def _fdopen(self, fd, *args, **kwargs):
        f = _REAL["fdopen"](fd, *args, **kwargs)
        rel = self._fd(fd)
        return f if rel is None else _RecordedFile(f, self, rel)


class _RecordedFile:
    """A file from ``os.fdopen`` whose ``write`` calls are recorded."""

    def __init__(self, f, rec: DiskRecorder, rel: str):
        self._f, self._rec, self._rel = f, rec, rel

    def write(self, data):
        with self._rec.lock:
            self._rec._call("write", self._rel)
            return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def power_state(dump: dict, side: Path, out: Path) -> None:
    """Build in ``out`` what a power cut leaves: the durable entries, each file's synced bytes."""
    dirs = dump["durable_dirs"]

    def build(rel: str, path: Path) -> None:
        path.mkdir()
        for name, (kind, gen) in dirs.get(rel, {}).items():
            child = name if rel == "." else f"{rel}/{name}"
            if kind == "d":
                build(child, path / name)
            elif (side / str(gen)).exists():
                shutil.copyfile(side / str(gen), path / name)
            else:
                (path / name).touch()  # the name survived, the never-synced bytes did not

    build(".", out)


# ----- what may be loaded after a stop --------------------------------------------------------


def _done(trace: list[list], kind: str, a: str | None = None, b: str | None = None,
          after: int = -1) -> int | None:
    """Index of the first call ``kind`` (matching the paths given) after index ``after``."""
    for i in range(after + 1, len(trace)):
        k, x, y = trace[i]
        if k == kind and (a is None or x == a) and (b is None or y == b):
            return i
    return None


def allowed_labels(scenario: Scenario, performed: list[list], stopped) -> set[str]:
    """The versions a state may load after the calls ``performed`` (and nothing after them).

    Before the new manifest is renamed into place: only what was committed before the save
    (for a save of an already committed step, that step until its manifest is unlinked, then
    the step before it). Once the rename and the fsyncs of the step's directory and of
    ``steps/`` are done (the commit point), and after the save returned: only the new version.
    In between: either.
    """
    step_dir = f"steps/{scenario.step:012d}"
    manifest = f"{step_dir}/manifest.json"
    renamed = _done(performed, "replace", b=manifest)
    committed = None
    if renamed is not None:
        synced = _done(performed, "fsync-dir", step_dir, after=renamed)
        if synced is not None:
            committed = _done(performed, "fsync-dir", "steps", after=synced)
    if stopped == "returned" or committed is not None:
        return {"new"}
    before = {"old"}
    if scenario.resave and _done(performed, "unlink", manifest) is not None:
        before.add("prev")
    return before | ({"new"} if renamed is not None else set())


# ----- scenarios (driver side) ---------------------------------------------------------------

GROUPS = ["embed", "layers.0", "layers.1"]
FROZEN = "layers.1"
"""Never changes: its blob is found already stored (deduplicated) at every later save."""
NUMEL = 512


@dataclass(frozen=True)
class Scenario:
    name: str
    base: tuple[tuple[int, int], ...]
    """(step, version) saves committed before the save under test."""
    step: int
    version: int
    load_first: bool
    """The saving process loads the newest commit first (tracker references set: an unchanged
    group is hashed before writing); else it only opens the run (unchanged groups are written
    to a temp file, then found stored)."""
    resave: bool = False

    def labels(self) -> dict[str, tuple[int, int] | None]:
        """label -> (step, version) committed then (None: no commit at all)."""
        out: dict[str, tuple[int, int] | None] = {"old": self.base[-1] if self.base else None}
        if self.resave:
            out["prev"] = self.base[-2]
        out["new"] = (self.step, self.version)
        return out


SCENARIOS = {
    s.name: s for s in (
        Scenario("first", base=(), step=1, version=1, load_first=False),
        Scenario("next", base=((1, 1),), step=2, version=2, load_first=True),
        Scenario("resave", base=((1, 1), (2, 2)), step=2, version=3, load_first=False, resave=True),
    )
}


def content(group: str, version: int):
    """Weights and AdamW state of ``group`` at ``version`` (deterministic, all bits used)."""
    import torch

    gi = GROUPS.index(group)
    gen = torch.Generator().manual_seed(1000 + gi if group == FROZEN else 100 * version + gi)
    v = 0 if group == FROZEN else version
    return {
        f"param/{group}.weight": torch.randn(NUMEL, generator=gen),
        f"exp_avg/{group}.weight": torch.randn(NUMEL, generator=gen),
        f"exp_avg_sq/{group}.weight": torch.rand(NUMEL, generator=gen),
        f"step/{group}.weight": torch.tensor(float(v)),
    }


def provider_at(version: int | None):
    import torch

    from layerwise.ckpt import DictStateProvider

    if version is None:
        return DictStateProvider({g: {k: torch.zeros_like(t) for k, t in content(g, 0).items()}
                                  for g in GROUPS})
    return DictStateProvider({g: content(g, version) for g in GROUPS})


def _save(ck, step: int, version: int) -> None:
    ck.save(step, extra={"version": version}, data_position=10 * version)


def _set(prov, version: int) -> None:
    for g in GROUPS:
        for k, t in content(g, version).items():
            prov.state[g][k].copy_(t)


MUTANTS = ("fsync-noop", "manifest-before-blob-fsync")
"""Breakages a mutant child makes on purpose: ``fsync-noop``: ``os.fsync`` does nothing;
``manifest-before-blob-fsync``: the blobs' fsyncs (``BlobBatch.finish``) run after the manifest
is committed instead of before."""


def _defer_blob_fsync_past_commit() -> None:
    from layerwise.ckpt.blob_store import BlobBatch
    from layerwise.ckpt.run_dir import RunDir

    finish, commit, pending = BlobBatch.finish, RunDir.commit, []

    def late_commit(self, step, manifest):
        commit(self, step, manifest)
        while pending:
            finish(pending.pop(0))

    BlobBatch.finish = lambda self: pending.append(self)
    RunDir.commit = late_commit


def _child(sc: Scenario, run: Path, side: Path, dump: Path, stop_at: int | None,
           mutant: str | None) -> None:
    from layerwise.ckpt import Checkpointer

    prov = provider_at(None)
    ck = Checkpointer(run, provider=prov, policy="full", tracker_log=False)  # async, as in training
    if sc.load_first:
        ck.load()
    _set(prov, sc.version)
    if mutant == "manifest-before-blob-fsync":
        _defer_blob_fsync_past_commit()
    rec = DiskRecorder(run, side, dump, stop_at, fsync_has_effect=mutant != "fsync-noop")
    rec.start()
    _save(ck, sc.step, sc.version)
    ck.wait()
    rec.finish("returned")


def _run_child(sc: Scenario, base: Path, work: Path, stop_at: int | None,
               mutant: str | None) -> dict:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    run, side, dump, err = work / "run", work / "side", work / "dump.json", work / "err.txt"
    shutil.copytree(base, run)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _child(sc, run, side, dump, stop_at, mutant)
            code = 4  # not reached: the child ends in DiskRecorder.finish
        except BaseException:
            err.write_text(traceback.format_exc())
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        raise RuntimeError(f"{sc.name} child (stop at {stop_at}) failed with status {status}:\n"
                           f"{err.read_text() if err.exists() else ''}")
    return json.loads(dump.read_text())


def check_state(sc: Scenario, run: Path) -> dict:
    """Open the run, verify it, load its newest commit: which version is it, bit for bit?"""
    import torch

    from layerwise.ckpt import Checkpointer, RunDir

    out: dict = {"faults": [], "loaded": None}
    try:
        store = RunDir.open(run)
        out["faults"] = store.verify().faults
        prov = provider_at(None)
        ck = Checkpointer(run, provider=prov, async_save=False, tracker_log=False)
        try:
            if not ck.has_checkpoint():
                out["loaded"] = "old" if sc.labels()["old"] is None else "nothing"
                return out
            res = ck.load()
        finally:
            ck.close()
        for label, sv in sc.labels().items():
            if sv is None or res.step != sv[0] or res.extra != {"version": sv[1]}:
                continue
            if res.data_position != 10 * sv[1]:
                out["loaded"] = f"{label} with data_position {res.data_position}"
                return out
            want = provider_at(sv[1]).state
            bad = [f"{g}:{k}" for g in GROUPS for k in want[g]
                   if not torch.equal(prov.state[g][k], want[g][k])]
            out["loaded"] = label if not bad else f"{label} with wrong tensors {bad}"
            return out
        out["loaded"] = f"unknown (step {res.step}, extra {res.extra})"
    except Exception as e:  # any failure to open / verify / load is a finding, not a crash
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _prepare_base(sc: Scenario, base: Path) -> None:
    from layerwise.ckpt import Checkpointer

    prov = provider_at(None)
    with Checkpointer(base, provider=prov, policy="full", async_save=False, tracker_log=False) as ck:
        for step, version in sc.base:
            _set(prov, version)
            _save(ck, step, version)


def _violation(sc: Scenario, r: dict) -> str | None:
    allowed = allowed_labels(sc, r["performed"], r["stopped"])
    for state in ("kill", "power"):
        got = r[state]
        if got.get("error") or got["faults"] or got["loaded"] not in allowed:
            return f"{state}: {got} (allowed {sorted(allowed)})"
    return None


def run_scenario(sc: Scenario, work: Path, mutant: str | None = None) -> dict:
    base = work / "base"
    _prepare_base(sc, base)
    ref = _run_child(sc, base, work / "ref", None, mutant)
    total = ref["calls"]
    results = []
    order = range(total + 1, 0, -1) if mutant else range(1, total + 2)
    for n in order:
        d = _run_child(sc, base, work / "n", n, mutant)
        power = work / "n" / "power"
        power_state(d, work / "n" / "side", power)
        r = {"n": n, "stopped": d["stopped"], "performed": d["trace"],
             "kill": check_state(sc, work / "n" / "run"), "power": check_state(sc, power)}
        results.append(r)
        if mutant and _violation(sc, r):
            break
    shutil.rmtree(work)
    return {"scenario": sc.name, "mutant": mutant, "calls": total, "trace": ref["trace"],
            "results": results}


def _run_spec(work: Path, spec: str) -> dict:
    name, _, mutant = spec.partition(":")
    return run_scenario(SCENARIOS[name], work / spec.replace(":", "-"), mutant or None)


def main(argv: list[str]) -> int:
    """``WORKDIR SPEC...``; a spec is a scenario name, or ``scenario:mutant``. Each spec is one
    job of a pool of workers forked from here before any tensor work (every spec has its own
    directory; a report depends on its spec only, not on which worker ran it or when)."""
    import multiprocessing

    import torch

    torch.set_num_threads(1)  # forks stay cheap and safe; the model is tiny
    work = Path(argv[0])
    specs = argv[1:]
    for spec in specs:
        name, _, mutant = spec.partition(":")
        if name not in SCENARIOS or (mutant and mutant not in MUTANTS):
            raise SystemExit(f"unknown {spec!r}: scenarios {sorted(SCENARIOS)}, mutants {MUTANTS}")
    jobs = max(1, min(len(specs), os.cpu_count() or 1, 4))
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        results = pool.starmap(_run_spec, [(work, spec) for spec in specs], chunksize=1)
    print(json.dumps(dict(zip(specs, results))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
