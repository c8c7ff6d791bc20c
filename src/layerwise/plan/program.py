"""The step program: the exact sequence of operations one micro-batch runs under a Plan.

It is plain data (no tensors), so the same list drives the engine's executor, its weight
prefetch schedule, the device-memory prediction and the planner's simulator: what is predicted
is what runs.

Op kinds (``i`` is a layer index):

- ``embed_fwd``: embedding of the input ids -> boundary 0;
- ``layer_fwd i``: layer i forward (no graph); its input boundary i is stored per the plan first;
- ``head``: final norm + lm_head + loss in chunks, with grads -> grad of the last boundary;
- ``fetch i``: bring stored boundary i back to the device (no-op for the device tier);
- ``recompute_embed``: rebuild boundary 0 from the input ids;
- ``recompute_layer i``: layer i forward (no graph) to rebuild boundary i+1;
- ``layer_bwd i``: layer i forward with a graph + backward; grads to the host;
- ``embed_bwd``: embedding backward; grads to the host.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str
    index: int = -1

    def units(self, tied: bool) -> tuple[str, ...]:
        """Units whose weights this op needs on the device, in order of first use."""
        if self.kind in ("embed_fwd", "recompute_embed", "embed_bwd"):
            return ("embed",)
        if self.kind in ("layer_fwd", "recompute_layer", "layer_bwd"):
            return (f"layers.{self.index}",)
        if self.kind == "head":
            return ("embed", "head") if tied else ("head",)
        return ()

    def __str__(self) -> str:
        return self.kind if self.index < 0 else f"{self.kind} {self.index}"


def micro_batch_program(tiers: list[str]) -> list[Op]:
    """The ops of one micro-batch for the boundary tiers of a plan."""
    num_layers = len(tiers)
    ops = [Op("embed_fwd")]
    ops += [Op("layer_fwd", i) for i in range(num_layers)]
    ops.append(Op("head"))
    on_device: set[int] = set()  # boundaries present on the device during the backward
    for i in reversed(range(num_layers)):
        if i not in on_device:
            if tiers[i] != "recompute":
                ops.append(Op("fetch", i))
                on_device.add(i)
            else:
                below = [j for j in range(i) if tiers[j] != "recompute"]
                if below:
                    j = below[-1]
                    if j not in on_device:
                        ops.append(Op("fetch", j))
                        on_device.add(j)
                else:
                    j = 0
                    ops.append(Op("recompute_embed"))
                    on_device.add(0)
                for k in range(j, i):
                    ops.append(Op("recompute_layer", k))
                    on_device.add(k + 1)
        ops.append(Op("layer_bwd", i))
        on_device.discard(i)
    ops.append(Op("embed_bwd"))
    return ops


def weight_schedule(ops: list[Op], tied: bool) -> list[str]:
    """Units in the order the ops need them (a unit used by consecutive ops appears once each)."""
    return [u for op in ops for u in op.units(tied)]
