"""The files of a model that are not weights (tokenizer, chat template, ``generation_config``),
copied beside merged weights so ``AutoTokenizer.from_pretrained(merged)`` and ``generate`` work.
From ``--tokenizer DIR``, else the source's own (a train run's ``OUT/tokenizer/``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ...ckpt.run_format import OUT_DIR_CKPT
from ..layout import GENERATION_CONFIG_NAME

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
"""Files that make up a Hugging Face tokenizer (any one of the first four marks a directory as
having a tokenizer)."""

RUN_TOKENIZER_DIR = "tokenizer"
"""A ``layerwise train`` out_dir's copy of the run's tokenizer and generation config."""

MODEL_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG_NAME)


def has_tokenizer_files(directory: str | Path) -> bool:
    d = Path(directory)
    return d.is_dir() and any((d / n).is_file() for n in TOKENIZER_FILES[:4])


def model_files_of(source: object, given: str | Path | None) -> Path | None:
    """The directory whose tokenizer files and generation config a merge of ``source`` copies:
    ``given`` (refused when it has neither), else the source's own, else None."""
    if given is not None:
        d = Path(given)
        if not (has_tokenizer_files(d) or (d / GENERATION_CONFIG_NAME).is_file()):
            raise ValueError(f"--tokenizer {d}: no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}) "
                             f"or {GENERATION_CONFIG_NAME} there; pass an HF model dir or a "
                             "directory written by tokenizer.save_pretrained")
        return d
    run_dir = getattr(source, "run_dir", None)  # a layer-wise run: its out_dir's copy
    if run_dir is not None:
        run_dir = Path(run_dir)
        d = run_dir.parent / RUN_TOKENIZER_DIR if run_dir.name == OUT_DIR_CKPT else None
    else:
        d = getattr(source, "path", None)  # an HF model dir, a Trainer checkpoint
    if d is not None and (has_tokenizer_files(d) or (Path(d) / GENERATION_CONFIG_NAME).is_file()):
        return Path(d)
    return None


def copy_model_files(src: Path, dst: Path) -> list[str]:
    """Copy ``src``'s tokenizer files and generation config into ``dst`` (replacing a derived
    generation config); the names copied."""
    copied = []
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied
