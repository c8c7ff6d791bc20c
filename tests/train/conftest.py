"""Fixtures of the training-loop tests."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerwise.models import get_flavor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The ``llama-debug`` shape with the byte tokenizer's vocabulary, as ``save_pretrained``
    writes it (seeded: the same weights in every module)."""
    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_flavor("llama-debug").build_config(vocab_size=258)) \
        .save_pretrained(path)
    return path
