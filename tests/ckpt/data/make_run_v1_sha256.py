"""How ``run_v1_sha256/`` was made: once, with layerwise at commit 5bb8d3a (checkpoint
``format_version`` 1, blobs named by sha256), before format 2. Newer layerwise writes format 2
for a new run, so this script documents the fixture; it cannot remake it.
``run_v1_sha256_state.safetensors`` holds ``content(g, v)`` as this script made it (keys
``v{v}/<key>``; v3: the embed of a resumed save), so the tests never regenerate it (``torch.randn`` differs by CPU kernel path).

    PYTHONPATH=src python tests/ckpt/data/make_run_v1_sha256.py tests/ckpt/data/run_v1_sha256
"""
import random, shutil, sys
from pathlib import Path
import numpy as np, torch
from layerwise.ckpt import Checkpointer, DictStateProvider

def content(g, v):
    gen = torch.Generator().manual_seed(7 + 31 * v + len(g))
    return {f"param/{g}.weight": torch.randn(16, 8, generator=gen),
            f"param/{g}.bias": torch.randn(8, generator=gen).to(torch.bfloat16),
            f"exp_avg/{g}.weight": torch.randn(16, 8, generator=gen),
            f"exp_avg_sq/{g}.weight": torch.rand(16, 8, generator=gen),
            f"step/{g}.weight": torch.tensor(float(v))}
GROUPS = ["embed", "layers.0", "layers.1", "norm"]
out = Path(sys.argv[1]); shutil.rmtree(out, ignore_errors=True)
random.seed(0); np.random.seed(0); torch.manual_seed(0)
prov = DictStateProvider({g: content(g, 1) for g in GROUPS}, config={"model_type": "toy"})
ck = Checkpointer(out, provider=prov, policy="parity", async_save=False, tracker_log=False)
ck.save(10, extra={"v": 1}, data_position=10)
for g in ("embed", "layers.0", "layers.1"):  # norm frozen
    for k, t in content(g, 2).items(): prov.state[g][k].copy_(t)
ck.save(20, extra={"v": 2}, data_position=20)
ck.close()
(out / ".lock").unlink()
