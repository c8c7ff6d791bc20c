"""A layer's saved tensors that are not on the device stay as they are on the host tier."""

import torch

from layerwise.engine.backend import CpuBackend
from layerwise.engine.internals import KeptInternals


def test_a_saved_host_tensor_is_kept_not_offloaded():
    """On a GPU, FlashAttention saves its philox seed and offset as 0-d CPU tensors. The host
    tier keeps them as the tensors themselves: an offload would copy host memory to host
    memory, and the fetch would give the backward a device tensor where it saved a CPU one.
    The device is played by a CPU backend that calls itself ``cuda:0`` (nothing runs on it).

    Mutation seen failing: ``KeptInternals._pack`` without its ``t.device`` test (the seed is
    packed as an offloaded storage, with a D2H copy)."""
    backend = CpuBackend()
    internals = KeptInternals(backend)
    seed = torch.tensor(1234, dtype=torch.int64)
    backend.device = torch.device("cuda", 0)
    g = internals.begin(0, "host")
    packed = internals._pack(g, seed)
    assert packed[0] == "tensor" and packed[1] is not seed and torch.equal(packed[1], seed)
    assert g.stored == {} and backend.copied_bytes["d2h"] == 0
    assert internals._unpack(g, packed) is packed[1]
    backend.device = torch.device("cpu")  # on the device: offloaded as any activation
    packed = internals._pack(internals.begin(1, "host"), torch.ones(4))
    assert packed[0] == "host" and backend.copied_bytes["d2h"] == 16
