"""Timeline picture of a simulated step: one lane per stream, memory underneath."""

from __future__ import annotations

from pathlib import Path

from ..plan.program import OpKind
from .trace import LANES, SimResult

# one colour per kind of work, so a glance tells compute from copies from recompute
# (label prefix, legend name, colour); the first matching prefix wins. Compute ops are labelled
# by their kind, copies and host work by what they move (a fetch's copy by its op's kind).
COLOURS = [
    (OpKind.LAYER_FWD, "forward", "#4C72B0"), (OpKind.LAYER_BWD, "backward", "#DD8452"),
    (OpKind.RECOMPUTE_LAYER, "recompute", "#C44E52"), (OpKind.RECOMPUTE_EMBED, "recompute", "#C44E52"),
    (OpKind.HEAD, "head + loss", "#8172B3"),
    (OpKind.EMBED_FWD, "embedding", "#937860"), (OpKind.EMBED_BWD, "embedding", "#937860"),
    ("w ", "weights in", "#55A868"),
    (OpKind.FETCH, "activation in", "#64B5CD"), ("offload", "activation out", "#2A7F9E"),
    ("grad", "grads out", "#CCB974"), ("nvme", "NVMe I/O", "#8C8C8C"),
    ("update", "optimizer", "#DA8BC3"), ("accumulate", "grad accumulate", "#B0B0B0"),
    ("reduce", "grad reduction", "#17BECF"), ("all-reduce", "grad reduction", "#17BECF"),
]


def _colour(label: str) -> str:
    for prefix, _, c in COLOURS:
        if label.startswith(prefix):
            return c
    return "#999999"


def draw_timeline(sim: SimResult, path: str | Path, title: str | None = None, all_steps: bool = False) -> Path:
    """Write a PNG of the measured step (or every simulated step) of ``sim``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not sim.intervals:
        raise ValueError("the simulation has no trace; simulate with keep_trace=True")
    t0, t1 = (0.0, sim.window[1]) if all_steps else sim.window
    lanes = [k for k in LANES if any(iv.lane == k for iv in sim.intervals)]
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(14, 1.0 + 0.55 * len(lanes) + 2.2), sharex=True,
                                  gridspec_kw={"height_ratios": [len(lanes), 2.2]})
    for row, lane in enumerate(lanes):
        min_w = (t1 - t0) / 1500  # keep short copies visible (about one pixel)
        bars = [(iv.start - t0, max(iv.end - iv.start, min_w), _colour(iv.label)) for iv in sim.intervals
                if iv.lane == lane and iv.end > t0 and iv.start < t1]
        if bars:
            colours = [c for *_, c in bars]
            ax.broken_barh([(s, w) for s, w, _ in bars], (row - 0.4, 0.8),
                           facecolors=colours, edgecolors=colours, linewidth=0.6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlim(0, t1 - t0)
    p = sim.plan
    ax.set_title(title or (f"{p.source}: {sim.step_s:.3f} s/step, {sim.tokens_per_s:,.0f} tokens/s, "
                           f"{sim.achieved_tflops:.1f} TFLOPS, mbs {p.micro_batch_size} x {p.num_micro_batches}"))
    legend = dict.fromkeys((name, c) for _, name, c in COLOURS)  # one entry per kind of work
    ax.legend(handles=[Patch(color=c, label=name) for name, c in legend],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=len(legend), fontsize=7, frameon=False)
    # device memory over time (step function over allocation events)
    ev = []
    for a in sim.allocs:
        if a.tier == "device" and a.end > a.start:
            ev.append((a.start, a.nbytes))
            ev.append((a.end, -a.nbytes))
    ev.sort()
    xs, ys, cur = [], [], 0
    for t, d in ev:
        cur += d
        if t0 <= t <= t1:
            xs.append(t - t0)
            ys.append(cur / 2**30)
    axm.step(xs, ys, where="post", color="#4C72B0", lw=1)
    axm.axhline(sim.device_cap_bytes / 2**30, color="#C44E52", ls="--", lw=1, label="device cap")
    axm.set_ylabel("device GiB")
    axm.set_xlabel("seconds into the step")
    axm.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
