"""The public API: the names users import from ``layerwise`` itself stay there.

Mutation seen failing: ``StreamingEngine`` dropped from ``layerwise._EXPORTS``."""

import subprocess
import sys

import layerwise

PUBLIC = ["AdamW8bit", "Batch", "Checkpointer", "DeepSpeedCheckpointer", "EngineConfig",
          "LayerwiseCheckpointCallback", "Plan", "ShardedCheckpointer", "StreamingEngine",
          "TrainConfig", "export_store", "fsdp_checkpointer", "import_checkpoints", "load_store",
          "merge", "train"]
"""What the README and users import; removing one is a breaking change (a deprecation first)."""


def test_every_public_name_stays_and_resolves():
    assert set(PUBLIC) <= set(layerwise.__all__)
    for name in layerwise.__all__:
        assert getattr(layerwise, name) is not None, name


def test_import_layerwise_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, layerwise; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
