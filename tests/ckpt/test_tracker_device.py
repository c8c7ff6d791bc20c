"""The tracker's change for live weights on another device than the reference: computed there,
chunk by chunk, equal to the host computation (CUDA runs it on the GPU; here both are CPU)."""

import torch

from layerwise.ckpt.tracker import CHUNK_NUMEL, UpdateTracker


def test_device_path_equals_host_path_across_chunks():
    """Mutation checked: the device path summing only the first chunk fails this."""
    g = torch.Generator().manual_seed(0)
    live = torch.randn(3 * CHUNK_NUMEL + 17, generator=g)
    ref = torch.randn(3 * CHUNK_NUMEL + 17, generator=g)
    tracker = UpdateTracker.__new__(UpdateTracker)
    tracker._scratch = torch.empty(0)
    assert UpdateTracker._diff_norm_on_device(live, ref) == tracker._diff_norm(live, ref)
