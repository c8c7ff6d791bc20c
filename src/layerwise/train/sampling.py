"""Generations at each evaluation (``eval.samples`` / ``eval.prompts``): which prompts, and
greedy continuation through the engine's forward pass."""

from __future__ import annotations

import torch

from ..engine.batch import Batch

SAMPLE_PROMPT_TOKENS = 16


def sample_prompts(eval_set: list[Batch], prompts: list[str], count: int, tokenizer
                   ) -> list[list[int]]:
    """Token ids of the prompts to continue at each eval: ``prompts`` encoded, else the first
    ``SAMPLE_PROMPT_TOKENS`` tokens of ``count`` held-out rows."""
    if prompts:
        return [tokenizer.encode(p, eos=False) for p in prompts]
    rows = [row for b in eval_set for row in b.input_ids][:count]
    return [row[:SAMPLE_PROMPT_TOKENS].tolist() for row in rows]


@torch.no_grad()
def greedy_continue(forward_logits, ids: list[int], new_tokens: int, max_len: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``ids`` (each a full forward pass: no KV cache)."""
    out = list(ids)
    for _ in range(new_tokens):
        window = torch.tensor([out[-max_len:]])
        out.append(int(forward_logits(window)[0, -1].argmax()))
    return out[len(ids):]
