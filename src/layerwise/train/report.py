"""``layerwise report RUN``: one PNG and a short text summary of a training run.

Reads what ``layerwise train`` wrote in ``out_dir`` (``docs/formats.md``); a ``Checkpointer``
directory of another loop fills only the tracker and checkpoint panels. Panels, top to bottom:
loss, LR, gradient norm, tokens/s against the prediction, per-layer change, checkpoint history."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ckpt.run_dir import RunDir
from ..ckpt.run_format import OUT_DIR_CKPT, locate_run
from ..util.units import human_bytes

REPORT_NAME = "report.png"


@dataclass
class SaveInfo:
    """One committed checkpoint, from its manifest."""

    step: int
    policy: str
    written: list[str]
    """Groups whose bytes this save wrote."""
    selected: list[str]
    """Groups the save took (written, or found byte-identical to a stored version)."""
    bytes_written: int
    full_bytes: int
    """Bytes a full save of this step would write: every group's blob plus the step files."""
    groups: list[str]


@dataclass
class RunData:
    run_dir: Path
    info: dict[str, Any] = field(default_factory=dict)
    """``run.json`` (empty for a run without one)."""
    plan: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    tracker: list[dict[str, Any]] = field(default_factory=list)
    saves: list[SaveInfo] = field(default_factory=list)
    skipped_lines: int = 0
    """Lines of the JSONL files that were not whole rows (a killed run's last line)."""


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    rows, bad = [], 0
    if not path.exists():
        return rows, bad
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


def _saves(ckpt_dir: Path) -> list[SaveInfo]:
    store = RunDir.open(ckpt_dir)
    out = []
    for step in store.committed_steps():
        m = store.read_manifest(step)
        groups = m.get("groups", {})
        files = sum(int(f.get("nbytes", 0)) for f in m.get("files", {}).values())
        out.append(SaveInfo(
            step=step, policy=str(m.get("policy", "?")), written=list(m.get("groups_written", [])),
            selected=[g for g, e in groups.items() if e.get("saved_step") == step],
            bytes_written=int(m.get("bytes_written", 0)),
            full_bytes=sum(int(e.get("nbytes", 0)) for e in groups.values()) + files,
            groups=list(groups)))
    return out


def load_run(run: str | Path) -> RunData:
    """Everything the report reads from ``run`` (a ``layerwise train`` out_dir, or a checkpoint
    run directory). Raises ``ValueError`` when there is nothing to report."""
    root = Path(run)
    if not root.is_dir():
        raise ValueError(f"run directory {root} does not exist")
    if root.name == OUT_DIR_CKPT and (root.parent / "run.json").is_file():
        root = root.parent  # a `layerwise train` out_dir's ckpt/: report the whole run
    data = RunData(root, info=_read_json(root / "run.json"), plan=_read_json(root / "plan.json"))
    data.metrics, bad_m = _read_jsonl(root / "metrics.jsonl")
    data.tracker, bad_t = _read_jsonl(root / "tracker.jsonl")
    data.skipped_lines = bad_m + bad_t
    located = locate_run(root)
    ckpt = located if (located / "format.json").exists() else None
    if ckpt is not None:
        data.saves = _saves(ckpt)
        if not data.tracker and ckpt != root:
            data.tracker, bad = _read_jsonl(ckpt / "tracker.jsonl")
            data.skipped_lines += bad
    if not (data.metrics or data.tracker or data.saves):
        raise ValueError(f"{root} has nothing to report: no metrics.jsonl, tracker.jsonl or "
                         "committed checkpoints; pass a `layerwise train` out_dir")
    return data


# ----- text summary ------------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def _change_matrix(data: RunData) -> tuple[list[str], list[int], list[list[float]]]:
    """Groups (model order), tracker steps, and change[group][k] (nan where not measured)."""
    groups: list[str] = []
    for row in data.tracker:
        for g in row.get("groups", {}):
            if g not in groups:
                groups.append(g)
    steps = [int(r["step"]) for r in data.tracker]
    mat = []
    for g in groups:
        line = []
        for r in data.tracker:
            v = r.get("groups", {}).get(g, {}).get("change")
            line.append(float(v) if isinstance(v, (int, float)) else math.nan)
        mat.append(line)
    return groups, steps, mat


def summary_lines(data: RunData) -> list[str]:
    """A few lines: what ran, loss, throughput vs prediction, tracker, checkpoints."""
    info, rows = data.info, data.metrics
    out = []
    head = f"run {data.run_dir}"
    if info:
        head += (f": {info.get('model')} ({info.get('num_params', 0) / 1e6:.1f}M params, "
                 f"{info.get('num_layers')} layers) on {info.get('device')}, plan {info.get('plan')}")
        if info.get("hardware_source"):
            head += f", predicted on {info['hardware_source']}"
    out.append(head)
    if rows:
        last = rows[-1]["step"]
        tail = [r["loss"] for r in rows[-10:] if r.get("loss") is not None]
        text = (f"steps: {last}" + (f" of {info['steps']}" if info.get("steps") else "")
                + f"; loss {rows[0]['loss']:.4f} (step {rows[0]['step']}) -> "
                f"{sum(tail) / len(tail):.4f} (mean of the last {len(tail)})")
        evals = _evals(data)
        if evals:
            text += f"; eval {evals[0][1]:.4f} (step {evals[0][0]})"
            if len(evals) > 1:
                text += f" -> {evals[-1][1]:.4f} (step {evals[-1][0]})"
        out.append(text)
        tps = _median([r.get("tokens_per_s") for r in rows[1:] or rows])
        tfl = _median([r.get("tflops") for r in rows[1:] or rows])
        meas = _median([r.get("step_s") for r in rows[1:] or rows])
        pred = next((r["predicted_step_s"] for r in rows if r.get("predicted_step_s")), None)
        text = f"throughput: median {tps or 0:,.0f} tokens/s, {tfl or 0:.3g} TFLOPS; step time {meas or 0:.4g} s"
        if pred:
            text += f", predicted {pred:.4g} s (measured / predicted {(meas or 0) / pred:.2f})"
        mems = [r["device_mem_reserved_bytes"] for r in rows if r.get("device_mem_reserved_bytes")]
        if mems:
            text += f"; device memory reserved {max(mems) / 2**30:.2f} GiB"
        out.append(text)
    if data.tracker:
        groups, steps, mat = _change_matrix(data)
        ref = data.tracker[-1].get("reference", "saved")
        finals = [(g, m[-1]) for g, m in zip(groups, mat) if math.isfinite(m[-1])]
        text = (f"tracker: {len(steps)} observations of {len(groups)} groups "
                f"(change since {'the last saved version' if ref == 'saved' else 'the run start' if ref == 'start' else 'nothing: not measured'})")
        if finals:
            finals.sort(key=lambda gv: -gv[1])
            text += (f"; at step {steps[-1]} most: {finals[0][0]} {finals[0][1]:.3g}, least: "
                     f"{finals[-1][0]} {finals[-1][1]:.3g}")
        out.append(text)
    if data.saves:
        written = sum(s.bytes_written for s in data.saves)
        full = sum(s.full_bytes for s in data.saves)
        n_groups = len(data.saves[-1].groups)
        avg = sum(len(s.written) for s in data.saves) / len(data.saves)
        out.append(f"checkpoints: {len(data.saves)} saves (policy {data.saves[-1].policy}), "
                   f"{human_bytes(written)} written vs {human_bytes(full)} for full saves "
                   f"({written / max(full, 1):.0%}); {avg:.1f} of {n_groups} groups written per save")
    else:
        out.append("checkpoints: none (ckpt.every=0 and ckpt.at_end=false)")
    if data.skipped_lines:
        out.append(f"note: {data.skipped_lines} incomplete line(s) skipped")
    return out


# ----- the picture ------------------------------------------------------------------------


def _evals(data: RunData) -> list[tuple[int, float]]:
    """The run's evals, each once, by step: the start eval at the step it was measured (0, or
    the step a run started from another's checkpoint; a resumed run keeps its first run's),
    then those of ``metrics.jsonl``."""
    evals = {int(r["step"]): float(r["eval_loss"]) for r in data.metrics
             if r.get("eval_loss") is not None}
    start = data.info.get("eval_loss_start")
    if start is not None:
        evals.setdefault(int(data.info.get("eval_loss_start_step") or 0), float(start))
    return sorted(evals.items())


def _smooth(xs: list[float], span: int) -> list[float]:
    """Exponential moving average, debiased (so it starts at the first value)."""
    a, m, w, out = 2 / (span + 1), 0.0, 0.0, []
    for x in xs:
        m, w = (1 - a) * m + a * x, (1 - a) * w + a
        out.append(m / w)
    return out


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_xticks([])
    ax.set_yticks([])


def _sparse_ticks(ax, labels: list[str], axis: str, max_ticks: int = 24) -> None:
    every = max(1, math.ceil(len(labels) / max_ticks))
    idx = list(range(0, len(labels), every))
    if axis == "y":
        ax.set_yticks(idx, [labels[i] for i in idx])
    else:
        ax.set_xticks(idx, [labels[i] for i in idx], rotation=90 if len(idx) > 20 else 0)


def _plot_loss(ax, data: RunData) -> None:
    rows = data.metrics
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    ax.plot(steps, loss, color="#4C72B0", alpha=0.3, lw=0.8, label="train loss")
    ax.plot(steps, _smooth(loss, max(3, len(loss) // 20)), color="#4C72B0", lw=1.8,
            label="train loss (smoothed)")
    evals = _evals(data)
    if evals:
        ax.plot(*zip(*evals), "o-", color="#DD8452", lw=1.5, ms=4, label="eval loss")
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _plot_lr(ax, data: RunData) -> None:
    ax.plot([r["step"] for r in data.metrics], [r["lr"] for r in data.metrics], color="#55A868")
    ax.set_title("learning rate")
    ax.set_xlabel("step")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.grid(alpha=0.3)


def _plot_grad_norm(ax, data: RunData) -> None:
    rows = [r for r in data.metrics if r.get("grad_norm") is not None and math.isfinite(r["grad_norm"])]
    ax.plot([r["step"] for r in rows], [r["grad_norm"] for r in rows], color="#8172B3", lw=1)
    clipped = [r for r in rows if r.get("clip_coef") is not None and r["clip_coef"] < 1]
    if clipped:
        ax.scatter([r["step"] for r in clipped], [r["grad_norm"] for r in clipped], s=10,
                   color="#C44E52", zorder=3, label=f"clipped ({len(clipped)} steps)")
        ax.legend(fontsize=8)
    skipped = [r["step"] for r in data.metrics if r.get("skipped")]
    for s in skipped:
        ax.axvline(s, color="#C44E52", lw=0.8, ls=":")
    norms = [r["grad_norm"] for r in rows]
    if norms and min(norms) > 0 and max(norms) > 20 * min(norms):  # spikes: a log axis shows both
        ax.set_yscale("log")
    ax.set_title("gradient norm (before clipping)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def _plot_throughput(ax, data: RunData) -> None:
    rows = data.metrics
    steps = [r["step"] for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    ax.plot(steps, tps, color="#937860", alpha=0.35, lw=0.8, label="measured, per step")
    ax.plot(steps, _smooth(tps, max(3, len(tps) // 20)), color="#937860", lw=1.8,
            label="measured (smoothed)")
    pred = [(r["step"], r["tokens"] / r["predicted_step_s"]) for r in rows
            if r.get("predicted_step_s") and r.get("tokens")]
    if pred:
        ax.plot(*zip(*pred), "--", color="#222222", lw=1.2, label="predicted by the planner")
    tfl = _median([r.get("tflops") for r in rows[1:] or rows])
    ax.set_title(f"tokens/s (median {tfl or 0:.3g} TFLOPS)")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _plot_heatmap(fig, ax, data: RunData) -> None:
    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm

    groups, steps, mat = _change_matrix(data)
    arr = np.array(mat, dtype=float) if mat else np.zeros((0, 0))
    finite = arr[np.isfinite(arr) & (arr > 0)] if arr.size else arr
    if not finite.size:
        _empty(ax, "no per-layer change measured (tracker off, or no reference yet)"
               if data.tracker else "no tracker.jsonl (log.track_every=0)")
        ax.set_title("relative change per layer")
        return
    masked = np.ma.masked_invalid(np.where(arr > 0, arr, np.nan))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#eeeeee")
    im = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap,
                   norm=LogNorm(vmin=float(finite.min()), vmax=float(finite.max())))
    _sparse_ticks(ax, groups, "y", 32)
    _sparse_ticks(ax, [str(s) for s in steps], "x", 30)
    ax.set_xlabel("step")
    ref = data.tracker[-1].get("reference", "saved")
    since = {"saved": "since the group's last saved version", "start": "since the run's start"}
    ax.set_title(f"relative weight change |w - w_ref| / |w_ref| per group, {since.get(ref, '')} "
                 "(grey: not measured)")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)


def _plot_saves_matrix(ax, data: RunData) -> None:
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    if not data.saves:
        _empty(ax, "no checkpoints (ckpt.every=0, ckpt.at_end=false)")
        ax.set_title("checkpoint history: groups per save")
        return
    groups = data.saves[-1].groups
    arr = np.zeros((len(groups), len(data.saves)))
    for j, s in enumerate(data.saves):
        for i, g in enumerate(groups):
            arr[i, j] = 2 if g in s.written else 1 if g in s.selected else 0
    colours = ["#f2f2f2", "#9ecae1", "#08519c"]
    ax.imshow(arr, aspect="auto", interpolation="nearest", cmap=ListedColormap(colours),
              vmin=0, vmax=2)
    _sparse_ticks(ax, groups, "y", 32)
    _sparse_ticks(ax, [str(s.step) for s in data.saves], "x", 30)
    ax.set_xlabel("checkpoint at step")
    ax.set_title(f"checkpoint history: groups each save wrote (policy {data.saves[-1].policy})")
    ax.legend(handles=[Patch(color=colours[2], label="written"),
                       Patch(color=colours[1], label="taken, bytes unchanged"),
                       Patch(color=colours[0], label="older version kept")],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _plot_save_bytes(ax, data: RunData) -> None:
    if not data.saves:
        _empty(ax, "no checkpoints")
        ax.set_title("checkpoint bytes")
        return
    x = list(range(len(data.saves)))
    full = [s.full_bytes / 2**20 for s in data.saves]
    wrote = [s.bytes_written / 2**20 for s in data.saves]
    ax.bar(x, full, color="#dddddd", label="a full save")
    ax.bar(x, wrote, color="#08519c", width=0.6, label="written")
    _sparse_ticks(ax, [str(s.step) for s in data.saves], "x", 20)
    total = sum(s.bytes_written for s in data.saves) / max(1, sum(s.full_bytes for s in data.saves))
    ax.set_title(f"checkpoint bytes: {total:.0%} of full saves")
    ax.set_ylabel("MiB")
    ax.set_xlabel("checkpoint at step")
    ax.legend(fontsize=8)


def draw_report(data: RunData, out: str | Path) -> Path:
    """Write the report PNG of ``data`` to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_groups = max(len(_change_matrix(data)[0]), len(data.saves[-1].groups) if data.saves else 0)
    map_h = min(7.0, max(2.6, 0.16 * n_groups))
    saves_h = map_h if data.saves else 1.0  # no checkpoints: one line saying so
    fig = plt.figure(figsize=(15, 7.2 + map_h + saves_h), layout="constrained")
    grid = fig.add_gridspec(4, 2, height_ratios=[3.2, 3.2, map_h, saves_h], width_ratios=[3, 2])
    panels = [(grid[0, 0], _plot_loss), (grid[0, 1], _plot_lr),
              (grid[1, 0], _plot_throughput), (grid[1, 1], _plot_grad_norm)]
    for spec, fn in panels:
        ax = fig.add_subplot(spec)
        if data.metrics:
            fn(ax, data)
        else:
            _empty(ax, "no metrics.jsonl")
    _plot_heatmap(fig, fig.add_subplot(grid[2, :]), data)
    _plot_saves_matrix(fig.add_subplot(grid[3, 0]), data)
    _plot_save_bytes(fig.add_subplot(grid[3, 1]), data)
    fig.suptitle("\n".join(summary_lines(data)[:3]), fontsize=10, ha="left", x=0.01)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out


def report(run: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Draw ``run``'s report (default ``report.png`` in the run's out_dir, also when ``run`` is
    its ``ckpt/``); return its path and the summary."""
    data = load_run(run)
    path = draw_report(data, Path(out) if out is not None else data.run_dir / REPORT_NAME)
    return path, summary_lines(data)
