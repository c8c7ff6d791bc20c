import sys
from pathlib import Path

import pytest
import torch

# ``multiproc`` (the multi-process tests' helper) imports as a top-level module from every test
# folder, with or without an ``__init__.py``, and in the children it starts.
sys.path.insert(0, str(Path(__file__).parent))


PROCESS_FIXTURES = {"zero_dir"}
"""Fixtures that run multi-process sessions: a test that uses one is a ``dist`` test."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)
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
