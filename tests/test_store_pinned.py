"""HostStore host memory: one pinned arena for the copy sources, byte accounting, the RAM check.

There is no CUDA here, so pinning is faked at the one place that talks to the runtime
(``util.host_memory.page_lock``): the arena logic around it (one allocation, page-aligned, exact
size, per-unit alignment, what is and is not in it) runs for real.
"""

import pytest
import torch

from layerwise import store as store_mod
from layerwise.util import host_memory
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.optim.adamw8bit import HostAdamW8bit
from layerwise.plan import Plan
from layerwise.planner.cost import STATE_NBYTES, CostModel
from layerwise.planner.presets import PRESETS
from layerwise.plan.shape import ModelShape
from layerwise.split_master import split_torch
from layerwise.store import ARENA_ALIGN_BYTES, HostStore, StoreFootprint, check_host_memory, store_footprint
from layerwise.util.host_memory import available_host_memory, page_size

PLENTY = lambda: 1 << 50  # noqa: E731 - an available-RAM reader that never refuses


@pytest.fixture(scope="module")
def adapter():
    # llama-debug: units are not whole multiples of 256 bytes, so the arena has padding
    return DecoderAdapter(get_flavor("llama-debug").build_config())


@pytest.fixture
def locks(monkeypatch):
    """Fake page-locking: records each region instead of calling cudaHostRegister."""
    calls = []
    monkeypatch.setattr(host_memory, "page_lock", lambda region: calls.append(region))
    return calls


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_sources_are_aligned_views_of_one_exact_arena(adapter, locks, dtype):
    """Mutations that fail it: allocating each unit's copy source on its own (several page-lock
    calls, views of different storages); dropping the per-unit alignment (``align = 1``)."""
    store = HostStore(adapter, compute_dtype=dtype, pin=True, mem_available=PLENTY)
    assert len(locks) == 1  # one page-locked allocation for the whole model
    region = locks[0]
    page = page_size()
    assert region.data_ptr() % page == 0 and region.numel() % page == 0
    arena = store.arena
    assert arena.dtype == dtype and arena.data_ptr() == region.data_ptr()
    assert _storage_ptr(arena) == _storage_ptr(region)

    pos, padded = 0, 0
    for b in store:
        src = b.copy_source
        assert src is (b.compute if dtype != torch.float32 else b.master)
        assert _storage_ptr(src) == _storage_ptr(arena)  # a view, no copy
        off = src.data_ptr() - arena.data_ptr()
        assert off % ARENA_ALIGN_BYTES == 0  # aligned
        assert 0 <= off - pos < ARENA_ALIGN_BYTES  # in order, no overlap, no more padding than needed
        padded += off - pos
        pos = off + src.numel() * src.element_size()
    assert pos == arena.numel() * arena.element_size()  # exact: ends at the last unit's end
    assert padded == store.footprint().padding
    assert region.numel() == -(-pos // page) * page  # page-locked: the arena in whole pages
    assert store.pinned_nbytes() == region.numel()
    assert store.copy_source_nbytes() == sum(b.layout.numel for b in store) * dtype.itemsize


@pytest.mark.parametrize("split", [True, False])
def test_only_the_copy_sources_are_in_the_arena(adapter, locks, split):
    """With bf16 compute, the master's remainder (split) or the fp32 master (not split), grad
    and optimizer state are separate pageable buffers.

    Mutation that fails it: putting the master in the arena too (``master = source``), or the
    remainder in it."""
    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=True, mem_available=PLENTY,
                      split_master=split)
    opt = HostAdamW8bit(AdamWConfig())
    for b in store:
        opt.init_state(b)
    arena = _storage_ptr(store.arena)
    for b in store:
        assert b.split == split and (b.master is None) == split
        for t in (b.remainder if split else b.master, b.grad, *b.state.values()):
            assert _storage_ptr(t) != arena
        assert b.compute.dtype == torch.bfloat16
        assert (b.remainder.dtype == torch.int16) if split else (b.master.dtype == torch.float32)
    fp32 = HostStore(adapter, compute_dtype=torch.float32, pin=True, mem_available=PLENTY)
    for b in fp32:
        assert b.compute is None and _storage_ptr(b.master) == _storage_ptr(fp32.arena)
        assert _storage_ptr(b.grad) != _storage_ptr(fp32.arena)


def test_optimizer_state_is_never_pinned(adapter, monkeypatch):
    """Even over a pinned master, state is allocated pageable.

    Mutation that fails it: ``torch.zeros(n, pin_memory=buf.master.is_pinned())`` in
    ``HostAdamW.init_state`` or ``zeros_8bit(..., pin_memory=...)`` in ``HostAdamW8bit`` (pinning
    is impossible on this machine, so any attempt raises)."""
    store = HostStore(adapter, pin=False)

    def no_pinning(*a, **k):
        raise AssertionError("optimizer state must not be pinned")

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    for opt in (HostAdamW(AdamWConfig()), HostAdamW8bit(AdamWConfig())):
        for b in store:
            opt.init_state(b)
            assert b.state


def test_unpinned_store_pins_nothing(adapter, locks):
    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False, mem_available=PLENTY)
    assert not locks and store.pinned_nbytes() == 0
    assert all(_storage_ptr(b.compute) == _storage_ptr(store.arena) for b in store)


def test_a_fresh_store_is_zero_and_compute_follows_master(adapter, locks):
    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=True, mem_available=PLENTY)
    assert not store.arena.any()
    b = store["layers.0"]
    x = torch.randn(b.layout.numel)
    b.write_master(x)
    assert torch.equal(b.read_master(), x)  # the split master holds the fp32 values exactly
    assert torch.equal(b.compute, split_torch(x)[0])  # and its high half is the copy source
    # round to nearest: the copy is within half a bf16 ulp of the master, like torch's cast
    assert ((b.compute.float() - x).abs() <= (x.to(torch.bfloat16).float() - x).abs()).all()
    assert not store["layers.1"].compute.any()  # neighbours untouched


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_the_planner_predicts_are_what_the_store_holds(adapter, locks, moments, dtype):
    """``store_footprint`` (no allocation) and ``CostModel.host_store_bytes`` equal the live
    store's bytes to the byte, arena padding, pinned pages and optimizer state included.

    Mutations that fail it: leaving the padding out of ``StoreFootprint.total``; counting the
    pinned arena on top of the compute copy; an 8-bit state size without the per-block scales."""
    store = HostStore(adapter, compute_dtype=dtype, pin=True, mem_available=PLENTY)
    opt = HostAdamW(AdamWConfig()) if moments == "fp32" else HostAdamW8bit(AdamWConfig())
    for b in store:
        opt.init_state(b)
    live = store.footprint()
    state = sum(opt.state_nbytes(b.layout.numel) for b in store)
    assert live.state == state == sum(STATE_NBYTES[moments](b.layout.numel) for b in store)
    predicted = store_footprint(adapter, dtype, state_nbytes=state)
    assert predicted == live
    assert store.nbytes() == live.total
    if dtype == torch.bfloat16:
        assert live.padding > 0  # the case that needs counting
    n = sum(b.layout.numel for b in store)
    # bf16: the split master's remainder 2 + its high half, the copy, 2; fp32: the master is the copy
    master_and_copy = 4 * n
    assert live.total == master_and_copy + 4 * n + state + live.padding  # pinned is not extra
    assert store.pinned_nbytes() == predicted.pinned >= predicted.arena

    hw = PRESETS["h200"] if dtype == torch.bfloat16 else PRESETS["cpu"]
    assert hw.compute_dtype_bytes == dtype.itemsize
    cm = CostModel(ModelShape.from_config(adapter.config), hw, 1, 1)
    assert cm.host_store_bytes([moments] * len(store.units)) == store.nbytes()
    assert cm.store_footprint().pinned == store.pinned_nbytes()


def test_qwen2_5_14b_pins_only_its_copy_sources():
    """The figure a benchmark reports, from the meta-device layouts (nothing allocated).

    Mutation that fails it: the arena from torch's pinned allocator, which rounds it up to a
    power of two (34.36 GB for 29.54 GB: ratio 1.16). Pinning per tensor as before (master,
    grad, compute and fp32 moments, each rounded up) locked 502.5 GB: ratio 17."""
    cfg = get_flavor("qwen2.5-14b").build_config()
    fp = store_footprint(cfg, torch.bfloat16)
    assert fp.numel == ModelShape.from_config(cfg).num_params == 14_770_033_664
    assert fp.copy_source == 2 * fp.numel  # the bf16 copies
    assert fp.pinned_over_copy_source <= 1.05
    assert fp.pinned - fp.copy_source < page_size() + len(DecoderAdapter(cfg).units) * ARENA_ALIGN_BYTES
    assert fp.total == 8 * fp.numel + fp.padding  # split master 4 + grad 4 (+ moments once known)
    plain = store_footprint(cfg, torch.bfloat16, split_master=False)
    assert plain.total == 10 * fp.numel + fp.padding  # fp32 master beside the copy
    unpinned = store_footprint(cfg, torch.bfloat16, pin=False)
    assert unpinned.pinned == 0 and unpinned.total == fp.total


# ----- the RAM check ------------------------------------------------------------------------

def test_ram_check_refuses_before_allocating_and_says_what_to_do(adapter, locks, monkeypatch):
    """Mutation that fails it: checking after the buffers are allocated (the allocation
    counter below is then non-zero), or comparing without the optimizer state."""
    allocs = []
    real = store_mod.alloc_pinned
    monkeypatch.setattr(store_mod, "alloc_pinned", lambda n: allocs.append(n) or real(n))
    need = store_footprint(adapter, torch.bfloat16, state_nbytes=1000)
    with pytest.raises(ValueError) as e:
        HostStore(adapter, compute_dtype=torch.bfloat16, pin=True, state_nbytes=1000,
                  mem_available=lambda: need.total - 1)
    msg = str(e.value)
    for words in ("needs", "fp32 master", "fp32 grad", "compute copy", "optimizer state",
                  "pinned", "available", "8-bit", "smaller model", "more RAM"):
        assert words in msg, words
    assert not allocs and not locks
    HostStore(adapter, compute_dtype=torch.bfloat16, pin=True, state_nbytes=1000,
              mem_available=lambda: need.total)  # exactly enough is enough
    assert len(allocs) == 1


def test_ram_check_without_optimizer_state_says_what_moments_would_add():
    fp = StoreFootprint.of_numels([10**9], 2)
    with pytest.raises(ValueError, match=r"needs 8\.00 GB.*remainder.*moments will add about 8\.00 GB"):
        check_host_memory(fp, lambda: 10**9)
    check_host_memory(fp, lambda: None)  # unknown: not checked
    with pytest.raises(ValueError, match=r"needs 16\.00 GB"):
        check_host_memory(fp.with_state(8 * 10**9), lambda: 15 * 10**9)


def test_available_host_memory_reads_meminfo_and_the_cgroup_limit(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       100000000 kB\nMemAvailable:   50000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    monkeypatch.setattr(host_memory, "_MEMINFO", str(meminfo))
    monkeypatch.setattr(host_memory, "_CGROUP_ROOT", str(cg))
    assert available_host_memory() == 50000000 * 1024  # no cgroup files: MemAvailable
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("123\n")
    assert available_host_memory() == 50000000 * 1024  # v2 without a limit
    (cg / "memory.max").write_text(f"{10 * 2**30}\n")
    (cg / "memory.current").write_text(f"{4 * 2**30}\n")
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {2**30}\nactive_file 5\n")
    assert available_host_memory() == 7 * 2**30  # the container's limit binds
    for f in ("memory.max", "memory.current", "memory.stat"):
        (cg / f).unlink()
    (cg / "memory").mkdir()
    (cg / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    (cg / "memory" / "memory.usage_in_bytes").write_text("5\n")
    assert available_host_memory() == 50000000 * 1024  # v1 "unlimited"
    (cg / "memory" / "memory.limit_in_bytes").write_text(f"{3 * 2**30}\n")
    (cg / "memory" / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert available_host_memory() == 2 * 2**30


def test_the_host_memory_figure_can_be_given(monkeypatch):
    """``$LAYERWISE_HOST_MEM_AVAILABLE_BYTES`` replaces the kernel's figure (the GPU check gives
    its CUDA tests the host budget this way); a value that is not a number is a one-line error.
    Mutation seen failing: the variable read but ``MemAvailable`` returned."""
    monkeypatch.setenv(host_memory.HOST_MEM_ENV, "137400000000")
    assert available_host_memory() == 137_400_000_000
    monkeypatch.setenv(host_memory.HOST_MEM_ENV, "lots")
    with pytest.raises(ValueError, match="not a number of bytes"):
        available_host_memory()


def test_available_host_memory_on_this_machine():
    avail = available_host_memory()
    assert avail is None or avail > 0


# ----- training is unchanged ----------------------------------------------------------------

def test_training_on_an_arena_store_matches_per_unit_buffers(adapter, locks):
    """The engine trains the same on a (fake-)pinned arena store as on an unpinned one."""
    model = build_hf_model(adapter.config, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, adapter.vocab_size, (2, 17), generator=gen)
    batch = Batch(ids[:, :-1], ids[:, 1:])
    results = []
    for pin in (True, False):
        store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=pin, mem_available=PLENTY)
        store.copy_from_model(model)
        engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 2),
                                 EngineConfig(compute_dtype=torch.bfloat16))
        losses = [engine.train_step([batch]).loss for _ in range(3)]
        engine.synchronize()
        engine.close()
        results.append((losses, torch.cat([b.read_master() for b in store])))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.cuda
def test_on_cuda_the_arena_is_page_locked_in_place(adapter):
    """The real path: cudaHostRegister, not torch's power-of-two pinned allocator (which would
    warn here); every copy source is pinned and copies without blocking, nothing else is."""
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        store = HostStore(adapter, compute_dtype=torch.bfloat16)
    assert store.pinned
    assert store.pinned_nbytes() == store_footprint(adapter, torch.bfloat16).pinned
    for b in store:
        b.write_master(torch.randn(b.layout.numel))
        assert b.copy_source.is_pinned()
        assert not b.remainder.is_pinned() and not b.grad.is_pinned()
    src = store["layers.0"].copy_source
    dev = src.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src)
    del store, src, b
    gc.collect()  # unregisters the arena


class _RefusingCudart:
    """A CUDA runtime that refuses to register (error 1: cudaErrorInvalidValue) and counts the
    resets of its last-error state."""

    def __init__(self) -> None:
        self.cleared = 0

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the runtime's name
        return 1

    def cudaGetLastError(self):  # noqa: N802
        self.cleared += 1
        return 1


def test_a_refused_registration_clears_the_cuda_error_state(monkeypatch):
    """A failed ``cudaHostRegister`` leaves the runtime's last error set; the fallback's next
    kernel launch would raise it as its own. ``page_lock`` raises (the callers fall back to
    other memory, with a warning) only after resetting it.

    Mutation seen failing: ``page_lock`` raising without ``clear_cuda_error``."""
    cudart = _RefusingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    region = torch.empty(page_size(), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="cudaHostRegister .* failed with CUDA error 1"):
        host_memory.page_lock(region)
    assert cudart.cleared == 1


def test_the_cuda_runtime_is_found_among_the_mappings():
    maps = ("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.12\n"
            "7f40-7f50 rw-p 00000000 00:00 0\n")
    assert host_memory.mapped_cudart(maps) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert host_memory.mapped_cudart("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n") is None


def test_pageable_copy_sources_on_a_gpu_are_warned_about(adapter):
    """A store without a page-locked arena (``pin=False``, or locking refused) feeding a GPU:
    every weight copy would be staged by the driver from pageable memory (the engine warns with
    this text when it is built on CUDA); nothing is said on the CPU backends or for a pinned
    store.

    Mutation seen failing: ``pageable_copy_warning`` testing ``store.pinned`` (the request)
    instead of the bytes actually locked (a refused lock goes unreported)."""
    from layerwise.engine.executor import pageable_copy_warning

    pageable = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False, mem_available=PLENTY)
    msg = pageable_copy_warning(torch.device("cuda", 0), pageable)
    assert msg is not None and "pageable" in msg and "pin=True" in msg
    assert pageable_copy_warning(torch.device("cpu"), pageable) is None
    refused = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False, mem_available=PLENTY)
    refused.pinned = True  # asked for, but nothing was locked
    assert pageable_copy_warning(torch.device("cuda", 0), refused) is not None
    refused._pinned_nbytes = 4096
    assert pageable_copy_warning(torch.device("cuda", 0), refused) is None
