"""Host optimizers over a unit's flat buffers: fused AdamW, block-wise 8-bit AdamW (per unit and
as a drop-in ``torch.optim.Optimizer``), the global-norm clip, and the 8-bit quantisation."""
