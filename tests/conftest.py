import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# ``multiproc`` (the multi-process tests' helper) imports as a top-level module from every test
# folder, with or without an ``__init__.py``, and in the children it starts.
sys.path.insert(0, str(Path(__file__).parent))


PROCESS_FIXTURES = {"zero_dir"}
"""Fixtures that run multi-process sessions: a test that uses one is a ``dist`` test."""


NUMBA_LOCK = "LAYERWISE_TEST_NUMBA_LOCK"
"""The file the controller's kernel warm-up holds locked while it compiles (``numba_warm.py``)."""


def pytest_configure(config):
    """On the pytest-xdist controller: compile the numba kernels once, into their cache, in a
    child that runs while the workers start and collect; the workers wait for it before their
    first test (``_numba_warm``) and load the machine code instead of each compiling it (and
    each multi-process test's child after them). With the cache built (``make install`` builds
    it) the child takes a few seconds."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) \
            or NUMBA_LOCK in os.environ:
        return
    lock = Path(tempfile.gettempdir()) / f"layerwise-numba-warm-{os.getpid()}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    subprocess.Popen([sys.executable, str(Path(__file__).parent / "numba_warm.py")], pass_fds=(fd,),
                     stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(fd)  # the child holds the lock until it exits
    os.environ[NUMBA_LOCK] = str(lock)  # the workers inherit it
    config.add_cleanup(lambda: lock.unlink(missing_ok=True))


@pytest.fixture(scope="session", autouse=True)
def _numba_warm():
    """Wait for the controller's kernel warm-up to end (no-op without one)."""
    path = os.environ.get(NUMBA_LOCK)
    if path and Path(path).exists():
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)
    # the multi-process tests (the longest) first, so that pytest-xdist's workers do not end
    # on them one at a time; the order within each part stays (pytest-randomly's, when on)
    items.sort(key=lambda item: "dist" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    if any("dist" in item.keywords for item in session.items):
        import multiproc

        multiproc.context()  # the fork server imports while the single-process tests run


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test on one intra-op thread (restored after it). ``make test`` runs two pytest-xdist
    workers on two cores: with torch's default (a thread per core) each worker's OpenMP team
    fights the other's, and the tiny models here wait on those threads more than they compute
    (tests/engine/test_training.py and test_gradients.py: 1.7x longer on two threads than on
    one). The children the tests start already run on one (``OMP_NUM_THREADS=1``), so in-process
    references now match them by default; the kernels' threaded paths are tested with explicit
    ``num_threads`` (tests/optim)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["cpu", "cpu-async"])
def engine_device(request):
    """Every engine test runs on the synchronous CPU backend and on the asynchronous one, which
    plays the GPU's protocol (lanes as threads with seeded random delays)."""
    return request.param


def _assert_engine_idle(engine):
    assert engine.streamer.finished(), "weight slots still held"
    assert not engine.acts.on_device and not engine.acts._entries, "boundaries still held"
    assert not engine.internals.layers, "kept layer internals still held"


@pytest.fixture
def assert_engine_idle():
    """After a step nothing is held: no weight copy resident, no boundary kept or offloaded."""
    return _assert_engine_idle


@pytest.fixture
def streamed_cpu(monkeypatch):
    """``device="cpu"`` engines copy weights into slots as on a GPU (the CPU backend otherwise
    reads the host weights in place): what tests of the device memory model measure."""
    from layerwise.engine import CpuBackend, executor

    real = executor.make_backend
    monkeypatch.setattr(executor, "make_backend", lambda device, seed=None: (
        CpuBackend(reads_host=False) if str(device) == "cpu" else real(device, seed)))
