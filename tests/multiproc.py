"""Multi-process tests: children forked from one preloaded server, rendezvous through a store the
test process holds, and an exit that cannot race the interpreter's teardown.

- **No import per child.** Every child is forked from the session's fork server
  (``multiprocessing``'s ``forkserver``), which imported torch, transformers, DeepSpeed and
  layerwise once, single-threaded, under ``OMP_NUM_THREADS=1``. A child that imported them
  itself spent 5-20 s of a 2-core machine doing so, and the suite starts ~30 of them.
- **No port race.** The test process hosts each launch's ``TCPStore`` (bound to port 0, its
  ``.port`` handed to the children) and the children join as clients, the way torchrun's agent
  hosts the store (``TORCHELASTIC_USE_AGENT_STORE``): ``env://`` and ``tcp://`` rendezvous then
  connect instead of binding. A port reserved by bind-and-release can be taken by anyone before
  rank 0 binds it again.
- **No teardown race.** A child's work returns (its DTensors and modules die with its frame),
  then it meets the others at a barrier, destroys its process group, flushes and leaves with
  ``os._exit``: gloo's threads are never torn down by the interpreter's shutdown, where a
  ``std::thread`` still joinable aborts the process ("terminate called without an active
  exception").
- **Waits on events.** The parent waits on the children's sentinels with a deadline, and on a
  failure or a timeout kills every child and raises with the tail of each child's log.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict", "torch.distributed.tensor",
    "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "layerwise.train.loop", "layerwise.cli", "layerwise.ckpt.sharded_checkpointer",
    "layerwise.interop.recipes.merge", "deepspeed", "accelerate",
]
"""What the fork server imports before it forks anyone (a module that fails to import is skipped,
and its child imports it itself)."""

SERVER_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
"""The fork server's environment on top of the test process's: one thread per rank, as the
in-process references run (a 2-thread matmul rounds differently on some CPUs), and DeepSpeed
on the CPU (it picks its accelerator once, at import)."""

_server_started = False


def context() -> multiprocessing.context.BaseContext:
    """The session's fork-server context, the server started on first use."""
    global _server_started
    ctx = multiprocessing.get_context("forkserver")
    if not _server_started:
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in SERVER_ENV}
        os.environ.update(SERVER_ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _server_started = True
    return ctx


class Store:
    """A ``TCPStore`` server held by the test process for one process group's rendezvous: its
    port is listening before any child exists and stays taken until ``close``."""

    def __init__(self) -> None:
        from torch.distributed import TCPStore

        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self._store.port

    def close(self) -> None:
        self._store = None


@dataclass
class _Spec:
    fn: Callable
    args: tuple
    world: int
    port: int
    log: str
    env: dict[str, str]
    rank_env: list[dict[str, str]]
    umasks: list[int | None]
    split_stderr: bool


def _redirect_output(out: str, err: str | None) -> None:
    """fds 1 and 2 (and ``sys.stdout``/``sys.stderr``, line-buffered) to ``out`` (2: ``err``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    if err is not None:
        os.close(fd)
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _child(rank: int, spec: _Spec) -> None:
    """A child's whole life: its log, umask and torchrun-style environment, ``fn(rank, *args)``,
    then ``leave``."""
    _redirect_output(f"{spec.log}.{rank}.log", f"{spec.log}.{rank}.err" if spec.split_stderr else None)
    if spec.umasks[rank] is not None:
        os.umask(spec.umasks[rank])
    if spec.port:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port), RANK=str(rank),
                          WORLD_SIZE=str(spec.world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(spec.world), TORCHELASTIC_USE_AGENT_STORE="True")
    os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    os.environ.update(spec.env)
    os.environ.update(spec.rank_env[rank])
    import torch

    torch.set_num_threads(1)
    try:
        spec.fn(rank, *spec.args)
    except BaseException:
        traceback.print_exc()
        leave(1)
    leave(0)


def leave(code: int = 0, barrier: bool = True) -> None:
    """End this child. On success: meet the other ranks at a barrier (so that none closes its
    connections while another still reads), destroy the process group with no tensor of it left
    alive (the work's frame is gone), flush, ``os._exit(0)``. ``barrier=False`` where the group
    is known broken. On failure: flush and ``os._exit(code)`` at once (a peer may be gone)."""
    if code == 0:
        gc.collect()
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                if barrier:
                    dist.barrier()
                dist.destroy_process_group()
        except BaseException:
            traceback.print_exc()
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Child:
    """One child, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, log: Path):
        self.proc, self.log = proc, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"child {self.proc.pid}", timeout)
        return self.proc.exitcode

    def log_tail(self, n: int = 4000, suffix: str = ".log") -> str:
        """The last ``n`` characters of the child's output (``suffix=".err"``: its stderr,
        when split)."""
        try:
            return self.log.with_suffix(suffix).read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return ""


@dataclass
class Launch:
    """Children of one process group (``start``); a context manager that kills what is left."""

    children: list[Child]
    stores: list[Store]
    log: str
    _closed: bool = field(default=False, repr=False)

    def __getitem__(self, rank: int) -> Child:
        return self.children[rank]

    def __iter__(self):
        return iter(self.children)

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} ({c.returncode}) ---\n{c.log_tail()}{c.log_tail(suffix='.err')}"
                          for r, c in enumerate(self.children))

    def wait(self, timeout_s: float) -> None:
        """Every child ends with 0 within ``timeout_s``; else kill them all and raise with their
        logs (the first failure does not wait for the others' timeouts)."""
        deadline = time.monotonic() + timeout_s
        pending = {c.proc.sentinel: c for c in self.children}
        while pending:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(pending), timeout=max(0.0, left))
            if not ready:
                self.kill()
                raise AssertionError(f"children still running after {timeout_s:g} s\n{self.logs()}")
            for s in ready:
                c = pending.pop(s)
                c.proc.join()
                if c.returncode != 0:
                    self.kill()
                    raise AssertionError(f"a child exited with {c.returncode}\n{self.logs()}")
        self.close()

    def kill(self) -> None:
        for c in self.children:
            c.kill()
        for c in self.children:
            c.proc.join(30)
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for st in self.stores:
                st.close()

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def start(fn: Callable, args: tuple = (), world: int = 2, *, log: str | Path | None = None,
          env: dict[str, str] | None = None, rank_env: list[dict[str, str]] | None = None,
          umasks: list[int | None] | None = None, stores: list[Store] | None = None,
          split_stderr: bool = False) -> Launch:
    """Start ``fn(rank, *args)`` in ``world`` children forked from the fork server, with
    torchrun's variables plus ``env`` and ``rank_env[rank]``; ``MASTER_PORT`` is the port of
    ``stores[0]`` (default: a new store), stores this process holds until the launch ends (a
    child that joins several process groups in turn takes the other stores' ports from its
    arguments: a store serves one group). ``stores=[]``: children of no process group, without
    torchrun's variables. Each child's output goes to ``<log>.<rank>.log`` (a
    temporary prefix when ``log`` is None; ``split_stderr``: its stderr to ``<log>.<rank>.err``). ``fn`` must be importable (a module-level function).
    """
    ctx = context()
    if log is None:
        log = os.path.join(tempfile.mkdtemp(prefix="multiproc-"), "child")
    stores = [Store()] if stores is None else stores
    spec = _Spec(fn, tuple(args), world, stores[0].port if stores else 0, str(log), dict(env or {}),
                 list(rank_env or [{} for _ in range(world)]),
                 list(umasks or [None] * world), split_stderr)
    children = []
    try:
        for rank in range(world):
            proc = ctx.Process(target=_child, args=(rank, spec), daemon=False)
            proc.start()
            children.append(Child(proc, Path(f"{log}.{rank}.log")))
    except BaseException:
        for c in children:
            c.kill()
        raise
    return Launch(children, stores, str(log))


def run(fn: Callable, args: tuple = (), world: int = 2, *, timeout_s: float = 240,
        **kwargs: Any) -> None:
    """``start`` then ``wait``: every child ends with 0 within ``timeout_s``."""
    with start(fn, args, world, **kwargs) as launch:
        launch.wait(timeout_s)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str,
             alive: Callable[[], bool] = lambda: True, poll_s: float = 0.01) -> Any:
    """Poll ``predicate`` until it is true (returned), ``alive()`` turns false or the deadline
    passes (AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if not alive():
            raise AssertionError(f"gave up waiting for {what}: the process it needs ended")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(poll_s)
