"""Compiled host kernels at the CPU's widest vectors.

LLVM tunes most AVX-512 CPUs to vectorise loops at 256 bits (its ``prefer-256-bit``, a guard
against the frequency drop of early AVX-512 chips), so numba's loops there use half the lanes
the CPU has. The host optimizer's 8-bit step is bound by its instruction count, not by memory:
at 512 bits it runs 1.3-1.4x faster on a Xeon with AVX-512 (``benchmarks/host_optimizer.py``). A jitted
kernel calls ``wide_vectors()`` first: it marks the function being compiled (its loops and
every helper inlined into it) ``"prefer-vector-width"="512"``. On a CPU without 512-bit
vectors the widest legal width stays 256, so the mark changes nothing there; and an element's
arithmetic is the same at any width (no reduction is reassociated by it), so results do not move.

numba keys a kernel's cache on the kernel's own file: after editing this one, clear the
kernels' caches (``__pycache__/*.nb*``) too.
"""

from __future__ import annotations

try:  # numba is optional: without it no kernel is compiled
    from numba import types as _nbt
    from numba.extending import intrinsic as _intrinsic
except Exception:  # pragma: no cover - depends on the environment
    _intrinsic = None

PREFERRED_VECTOR_BITS = 512

if _intrinsic is not None:

    @_intrinsic
    def wide_vectors(typingctx):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            # a string attribute with a value: llvmlite's ``add`` takes only its named
            # attributes, so this goes into the set directly (it is printed into the IR as is);
            # an llvmlite whose attributes are no set compiles at LLVM's own width
            try:
                set.add(builder.function.attributes,
                        f'"prefer-vector-width"="{PREFERRED_VECTOR_BITS}"')
            except TypeError:
                pass
            return context.get_dummy_value()
        return _nbt.none(), codegen
