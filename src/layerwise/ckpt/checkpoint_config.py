"""How a ``Checkpointer`` saves: ``CheckpointConfig`` (torch-free, in ``util.checkpoint_config``)
and the one flat namespace of options its constructor takes (config fields and the policy's
own options together)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from ..util.checkpoint_config import DEFAULT_POLICY, POLICY_OPTIONS, CheckpointConfig

__all__ = ["DEFAULT_POLICY", "CheckpointConfig", "split_options"]


def split_options(config: CheckpointConfig | None, options: dict[str, Any],
                  policy: Any = None) -> tuple[CheckpointConfig, dict[str, Any]]:
    """``config`` (default: no staleness bound) with the options that name its fields applied,
    and the policy's options: the config's and the rest of ``options`` (only those given here
    when ``policy`` is an instance, which holds its own)."""
    names = {f.name for f in fields(CheckpointConfig)}
    cfg = replace(config or CheckpointConfig(max_staleness=None),
                  **{k: v for k, v in options.items() if k in names})
    given = {k: v for k, v in options.items() if k in POLICY_OPTIONS or k not in names}
    if policy is not None and not isinstance(policy, str):
        return cfg, given
    return cfg, {**cfg.policy_options(), **given}
