"""Compiled host kernels at the CPU's widest vectors.

LLVM vectorises at 256 bits on most AVX-512 CPUs (``prefer-256-bit``); the 8-bit optimizer step
is instruction-bound and runs 1.3-1.4x faster at 512 (``benchmarks/host_optimizer.py``), so a
kernel calls ``wide_vectors()`` first. Elementwise results do not change with width. After
editing this file clear the kernels' ``__pycache__/*.nb*`` too."""

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
