"""The host kernels' vector width (``util/simd.py``): a kernel that calls ``wide_vectors`` is
compiled with LLVM's ``prefer-vector-width`` at 512 bits, which on a CPU with AVX-512 vectorises
its loops on 512-bit registers (LLVM's tuning for most such CPUs stays at 256)."""

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import llvmlite.binding as llvm  # noqa: E402  (numba's own dependency)

from layerwise.util.simd import wide_vectors  # noqa: E402


def _kernels():
    def add(d, s):
        for j in range(d.size):
            d[j] += s[j] * np.float32(0.5)

    def add_wide(d, s):
        wide_vectors()
        for j in range(d.size):
            d[j] += s[j] * np.float32(0.5)

    return numba.njit(add), numba.njit(add_wide)


def test_wide_vectors_marks_the_compiled_function_and_changes_no_result():
    """Mutation seen caught: ``wide_vectors``'s codegen adding nothing to the function."""
    plain, wide = _kernels()
    d, s = np.zeros(1000, np.float32), np.arange(1000, dtype=np.float32)
    plain(d, s)
    expect = d.copy()
    d[:] = 0
    wide(d, s)
    assert np.array_equal(d, expect)
    (sig,) = wide.signatures
    assert '"prefer-vector-width"="512"' in wide.inspect_llvm(sig)
    (sig,) = plain.signatures
    assert "prefer-vector-width" not in plain.inspect_llvm(sig)


@pytest.mark.skipif("+avx512f" not in llvm.get_host_cpu_features().flatten(), reason="needs AVX-512")
def test_on_avx512_the_marked_loop_runs_on_512_bit_registers():
    """Mutation seen caught: the same (this CPU's LLVM tuning then stays at 256-bit ``ymm``)."""
    plain, wide = _kernels()
    d, s = np.zeros(64, np.float32), np.ones(64, np.float32)
    plain(d, s)
    wide(d, s)
    assert "zmm" in wide.inspect_asm(wide.signatures[0])
