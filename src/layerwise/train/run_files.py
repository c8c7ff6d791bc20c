"""What rank 0 writes in a run's ``out_dir`` besides the logs: its lock, the plan,
``run.json``, the tokenizer and generation config every merge copies, and the export. Every
other rank of a data-parallel run has one with ``lead=False``: it writes nothing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from ..interop.hf.tokenizer_files import RUN_TOKENIZER_DIR, has_tokenizer_files
from ..interop.layout import GENERATION_CONFIG_NAME
from ..interop.recipes.store_export import export_store
from ..plan.plan import Plan
from ..store import HostStore
from ..util import dirlock
from .outdir import clear_run, write_run_json

_log = logging.getLogger(__name__)


class RunFiles:
    def __init__(self, out_dir: Path, lead: bool):
        self.out_dir, self.lead = out_dir, lead

    def claim(self) -> dirlock.DirLock | None:
        """The out_dir's lock: one run at a time."""
        return dirlock.acquire(self.out_dir) if self.lead else None

    def clear(self) -> None:
        """Remove the run files of an earlier run (``overwrite=true``)."""
        if self.lead:
            clear_run(self.out_dir)

    def save_plan(self, plan: Plan) -> None:
        if self.lead:
            plan.save(self.out_dir / "plan.json")

    def run_json(self, info: dict[str, Any]) -> None:
        if self.lead:
            write_run_json(self.out_dir, info)

    def save_model_files(self, tokenizer, model_path: str) -> None:
        """The run's tokenizer and the model's ``generation_config.json`` in
        ``out_dir/tokenizer``, which every merge of the run's checkpoints and the export copy
        beside the weights; rewritten by every run (none for the byte tokenizer of a flavor),
        except when it is where the run reads its tokenizer from (``layerwise demo``)."""
        if not self.lead:
            return
        final = self.out_dir / RUN_TOKENIZER_DIR
        gen = Path(model_path) / GENERATION_CONFIG_NAME
        source = getattr(tokenizer, "source", None)
        if source is not None and Path(source).resolve() == final.resolve():
            if gen.is_file():
                shutil.copyfile(gen, final / GENERATION_CONFIG_NAME)
            return
        tmp = self.out_dir / f".{RUN_TOKENIZER_DIR}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tokenizer.save(tmp)
        if gen.is_file():
            shutil.copyfile(gen, tmp / GENERATION_CONFIG_NAME)
        shutil.rmtree(final, ignore_errors=True)
        if any(tmp.iterdir()):
            tmp.rename(final)
        else:
            tmp.rmdir()

    def export(self, store: HostStore) -> Path | None:
        """The trained model as a Hugging Face directory, ``out_dir/model``, with the run's
        tokenizer files (None on the other ranks)."""
        if not self.lead:
            return None
        files = self.out_dir / RUN_TOKENIZER_DIR
        model_dir = export_store(store, self.out_dir / "model", overwrite=True,
                                 tokenizer=files if files.is_dir() else None)
        saved_tok = has_tokenizer_files(model_dir)
        _log.info(f"exported Hugging Face model{' and tokenizer' if saved_tok else ''} to "
                  f"{model_dir}")
        return model_dir

