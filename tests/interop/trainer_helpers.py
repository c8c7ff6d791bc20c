"""HF Trainer fixtures shared by the interop tests: a tiny token dataset and a Trainer factory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from layerwise.models.registry import FAMILIES, get_flavor


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq_len: int = 16, vocab: int = 96):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out_dir: Path, max_steps: int, flavor: str = "llama-debug", callbacks=None) -> Trainer:
    torch.manual_seed(0)
    model = FAMILIES["llama"].model_class(get_flavor(flavor).build_config())
    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear", save_strategy="steps", save_steps=2,
        logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=callbacks)


def losses(trainer: Trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
