"""The text ``layerwise plan`` prints: a one-line verdict, then the plans compared at one global
batch.

The verdict comes first and names the binding memory with its figures, because "will it fit, how
fast, how long" is what a newcomer asks. Tables are sized from their cells."""

from __future__ import annotations

from typing import Sequence

from .check import CheckReport
from .hardware import HardwareProfile
from .host_need import HostNeed, family_of_model
from .host_rates import GPU_RUN, PRESET_HOSTS, config_name
from ..plan.plan import Plan
from .scaling import ScalingPoint
from .search import Candidate, PlanInfeasible, SearchResult
from ..plan.shape import ModelShape
from .simulator import SimResult
from .state_traffic import HIDE_FRACTION, STEP_SLACK, NvmeState

MEMORY_NAMES = {"device": "GPU memory", "host": "host RAM", "nvme": "NVMe", "unknown": "memory"}
"""The capacities a plan can overflow, in a newcomer's words."""

COLUMN_GAP = "  "


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def hours_per_billion_tokens(tokens_per_s: float) -> float:
    return 1e9 / tokens_per_s / 3600


def _hours(h: float) -> str:
    """Three significant figures up to 1,000 h (0.197, 1.33, 18.6, 186), whole hours above."""
    return f"{h:,.0f}" if h >= 100 else f"{h:.1f}" if h >= 10 else f"{h:.2f}" if h >= 1 else f"{h:.3g}"


def run_name(shape: ModelShape) -> str:
    """The model, and for a LoRA / QLoRA run its adapters and base: ``llama3-8b (LoRA r=16, nf4 base)``."""
    return shape.name if shape.frozen_base is None else f"{shape.name} ({shape.frozen_base.label()})"


def verdict_fits(shape: ModelShape, hw: HardwareProfile, seq_len: int, sim: SimResult, global_batch: int,
                 scaling: Sequence[ScalingPoint] = ()) -> str:
    """``fits: yes — ...``: tokens/s, hours per billion tokens, and each memory's peak of its capacity.
    With data parallelism the figures are those of every GPU together (the last scaling point)."""
    tps = scaling[-1].tokens_per_s if scaling else sim.tokens_per_s
    gpus = f" x {scaling[-1].topology.world_size} GPUs" if scaling else ""
    mem = [f"GPU memory {_gb(sim.peak_device_bytes)} of {_gb(sim.device_cap_bytes)} GB",
           f"host RAM {_gb(sim.peak_host_bytes)} of {_gb(sim.host_cap_bytes)} GB"]
    if sim.peak_nvme_bytes:
        mem.append(f"NVMe {_gb(sim.peak_nvme_bytes)} of {_gb(sim.nvme_cap_bytes)} GB")
    return (f"fits: yes — {run_name(shape)} on {hw.name}{gpus}, {global_batch} x {seq_len} tokens per step: "
            f"{tps:,.0f} tokens/s predicted, {_hours(hours_per_billion_tokens(tps))} h per billion tokens "
            f"(peak {', '.join(mem)})")


def host_line(shape: ModelShape, machine: HardwareProfile, need: HostNeed) -> str:
    """``host RAM: ... B/param ...``: the chosen plan's host bytes per parameter (the store, then
    everything with activations and the reserve) against the machine's RAM."""
    grads = "bf16 gradients (one landing per step)" if need.bf16_grads else "fp32 gradients"
    verdict = "fits" if need.fits else f"short by {_gb(need.total_bytes - need.ram_bytes)} GB"
    return (f"host RAM: {need.store_bytes_per_param:.2f} B/param for the store ({_gb(need.store_bytes)} GB, {grads}), "
            f"{need.bytes_per_param:.2f} B/param in all with {_gb(need.activation_bytes)} GB of host-tier activations "
            f"and the {_gb(need.reserve_bytes)} GB reserve (runtime, CUDA context, OS, pinned gradient ring): "
            f"{_gb(need.total_bytes)} of {_gb(need.ram_bytes)} GB RAM on {machine.name} — {verdict}")


def nvme_state_line(shape: ModelShape, plan: Plan, fig: NvmeState, batch_note: str | None) -> str:
    """``optimizer state on NVMe: ...``: which units (and which of them ``nvme-all``, with their
    weights and gradients), how many bytes a step moves over the NVMe by kind, the NVMe's seconds
    for them against the compute's, and whether that hides."""
    units = plan.nvme_units(shape.unit_names())
    full = plan.nvme_units(shape.unit_names(), source=True)
    if not fig.hides:
        hides = f"does not hide (over {HIDE_FRACTION:.0%} of the compute): the step waits for the NVMe"
    elif fig.compute_bound:
        hides = f"hides (<= {HIDE_FRACTION:.0%} of the compute, the step within {STEP_SLACK:.0%} of it)"
    else:  # the reads run a few units ahead of the updates: most of it lands in the next forward
        hides = (f"under {HIDE_FRACTION:.0%} of the compute, but the next forward waits for the state's reads "
                 f"and writes: not hidden")
    if full:
        where = (f"{_gb(fig.state_bytes)} GB of master remainders and moments; {fig.all_units} of them nvme-all "
                 f"({_unit_names(full)}): their weights ({_gb(fig.source_bytes)} GB, the copy source) and "
                 f"gradients ({_gb(fig.grad_bytes)} GB) on NVMe too, the rest's in RAM")
    else:
        where = f"{_gb(fig.state_bytes)} GB (master remainders and moments; copy source and gradients in RAM)"
    kinds = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in fig.moved_by_kind.items() if v)
    return (f"optimizer state on NVMe: {fig.units} of {len(shape.unit_names())} units ({_unit_names(units)}), "
            f"{where}; {_gb(fig.moved_bytes)} GB over the NVMe per step ({kinds}), {fig.nvme_s:.2f} s of NVMe vs "
            f"{fig.compute_s:.2f} s of compute per step (step {fig.step_s:.2f} s, {fig.over_compute:+.1%} over the "
            f"compute): {hides}" + (f"; {batch_note}" if batch_note else ""))


def _unit_names(units: Sequence[str]) -> str:
    """``layers 0-3, 7, embed``: units with the layers' indices in runs."""
    layers = [int(u.rsplit(".", 1)[1]) for u in units if u.rsplit(".", 1)[-1].isdigit()]
    return ", ".join(([f"layers {_ranges(layers)}"] if layers else [])
                     + [u for u in units if not u.rsplit(".", 1)[-1].isdigit()])


def reserve_line(machine: HardwareProfile, hw: HardwareProfile) -> str:
    """What the host reserve of ``hw`` (``machine.for_model(...)``) is made of ([HOSTRES])."""
    ring = hw.host_reserved_bytes - machine.host_reserved_bytes
    return (f"host reserve: {_gb(hw.host_reserved_bytes)} of {_gb(machine.host_mem_bytes)} GB RAM = "
            f"{_gb(machine.host_reserved_bytes)} GB (runtime, CUDA context, OS, margin) + {_gb(ring)} GB "
            f"pinned gradient ring")


def largest_line(shape: ModelShape, machine: HardwareProfile, largest: tuple[str, HostNeed] | None) -> str:
    """``largest ... that fits ...``: by the host floor (``host_need.host_floor``) and a plan the
    GPU holds, each size planned as ``shape``'s run (full, or LoRA on the same base format)."""
    family = family_of_model(shape.name) or "this"
    how = "8-bit moments, bf16 gradients, no host-tier activations" if machine.compute_dtype_bytes == 2 \
        else "8-bit moments, no host-tier activations"
    if shape.frozen_base is not None:
        how = f"{shape.frozen_base.label()}, 8-bit adapter moments, no host-tier activations"
    if largest is not None and largest[1].nvme_state_bytes:
        how += ", optimizer state on NVMe where the RAM is short"
        if largest[1].nvme_weight_bytes:
            how += " (weights and gradients too where that is not enough)"
    where = f"{_gb(machine.host_mem_bytes)} GB of host RAM on {machine.name} ({how})"
    if largest is None:
        return f"largest {family} model that fits {where}: none"
    name, need = largest
    nvme = f", {_gb(need.nvme_state_bytes)} GB of optimizer state on NVMe" if need.nvme_state_bytes else ""
    if need.nvme_weight_bytes:
        nvme += f" and {_gb(need.nvme_weight_bytes)} GB of weights and gradients ({need.nvme_all_units} units nvme-all)"
    return (f"largest {family} model that fits {where}: {name}, {need.num_params / 1e9:.2f}B params, "
            f"{_gb(need.total_bytes)} GB ({need.bytes_per_param:.2f} B/param){nvme}")


def verdict_unfit(shape: ModelShape, hw: HardwareProfile, seq_len: int, err: PlanInfeasible) -> str:
    """``fits: no — ...``: which memory binds, by how much, and what would make it fit."""
    return (f"fits: no — {run_name(shape)} on {hw.name} at {seq_len} tokens per sequence: "
            f"{MEMORY_NAMES.get(err.resource, err.resource)} is short by {_gb(err.over_bytes)} GB. {err}")


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0, -1)) -> list[str]:
    """Lines of a table: the columns ``left`` (words) left-aligned, the others (figures) right-aligned, each as
    wide as its longest cell and ``COLUMN_GAP`` apart (a trailing empty cell adds no spaces)."""
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    lefts = {k % len(header) for k in left}

    def line(cells: Sequence[str]) -> str:
        return COLUMN_GAP.join(c.ljust(w) if k in lefts else c.rjust(w)
                               for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

    head = line(header)
    return [head, "-" * len(head), *(line(r) for r in rows)]


def table_rows(res: SearchResult) -> list[tuple[str, Candidate, str]]:
    """(name, candidate, note) of every row: the chosen plan first, the other fitting rules
    fastest first, then the rules that do not fit at this global batch, each saying why."""
    chosen = res.best
    fitting = sorted((c for n, c in res.by_name.items() if n != chosen.name), key=lambda c: -c.sim.tokens_per_s)
    rows = [(chosen.name, chosen, "chosen")] + [(c.name, c, "") for c in fitting]
    for name, c in sorted(res.unfit.items()):
        over = ", ".join(f"{MEMORY_NAMES[t]} {_gb(b)} GB over" for t, b in c.sim.over_capacity().items())
        rows.append((name, c, f"does not fit: {over}"))
    return rows


def _ranges(indices: Sequence[int]) -> str:
    """``0-2, 5``: sorted indices with runs joined."""
    out: list[str] = []
    for i in sorted(indices):
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def order_text(plan: Plan) -> str:
    """The step's order and the layers kept on the device, in words."""
    k = plan.micro_batches_per_load
    order = "micro-batch-major" if k == 1 else f"layer-major ({k} micro-batches per weight load)"
    res = plan.resident_layers
    resident = (f"resident layers {_ranges(res)} ({len(res)} of {plan.num_layers})" if res
                else "no resident layers")
    return f"order {order}; {resident}"


def print_report(seq_len: int, shape: ModelShape, hw: HardwareProfile, res: SearchResult, sim: SimResult,
                 report: CheckReport) -> None:
    """The machine, the table of the chosen plan against every rule, the MILP's figures, the plan."""
    p = res.plan
    counts = {t: p.boundary_tiers.count(t) for t in ("device", "host", "nvme", "recompute") if t in p.boundary_tiers}
    internal = {t: p.internal_tiers.count(t) for t in ("device", "host", "recompute") if t in p.internal_tiers}
    n8 = (p.moments or []).count("8bit")
    print(f"{shape.name} ({shape.num_params / 1e9:.2f}B params, {shape.num_layers} layers) on {hw.name}: "
          f"GPU memory {_gb(hw.device_cap_bytes)} GB usable, host RAM {_gb(hw.host_cap_bytes)} GB usable")
    print(f"every row at global batch {res.global_batch} sequences x {seq_len} tokens = "
          f"{res.global_batch * seq_len:,} tokens per step (each rule at its fastest micro-batch size)")
    best_tps = res.best.sim.tokens_per_s
    cells = []
    for name, c, note in table_rows(res):
        s = c.sim
        cells.append([name, f"{c.plan.micro_batch_size} x {c.plan.num_micro_batches}", f"{s.step_s:.3f}",
                      f"{s.tokens_per_s:,.0f}", f"{s.achieved_tflops:.1f}", _gb(s.peak_device_bytes),
                      _gb(s.peak_host_bytes), f"{s.tokens_per_s / best_tps:.2f}",
                      str(res.max_micro_batch_size.get(c.name, 0)), note])
    header = ["plan", "mbs x n", "step s", "tokens/s", "TFLOPS", "GPU GB", "host GB", "vs chosen", "max mbs", ""]
    for line in format_table(header, cells):
        print(line)
    m = res.milp
    if m is not None:
        print(f"MILP at micro-batch {p.micro_batch_size}: {m.status}, model step {m.objective_s:.3f} s, bound {m.bound_s:.3f} s, gap {m.gap:.2%}, "
              f"warm start {m.warm_start or 'none'}; HiGHS {res.solve_s:.2f} s, search {res.plan_s:.2f} s")
    print(f"chosen plan ({p.source}): {order_text(p)}; boundaries {', '.join(f'{v} {k}' for k, v in counts.items())}; "
          f"layer internals {', '.join(f'{v} {k}' for k, v in internal.items())}; prefetch depth {p.prefetch_depth}; "
          f"optimizer moments {len(p.moments or []) - n8} units fp32, {n8} units 8-bit; check: ok "
          f"(peak GPU {_gb(report.peaks['device'])} GB, host {_gb(report.peaks['host'])} GB)")
    print("busy per step: " + ", ".join(f"{k} {v:.2f}s" for k, v in sim.busy_s.items() if v > 0))
    for line in optimizer_lines(shape, hw, p):
        print(line)


def run_form(shape: ModelShape, hw: HardwareProfile, plan: Plan) -> tuple[str, str]:
    """(gradient, master) of the host store a run of ``plan`` keeps (``train/loop.py``): bf16
    gradients where bf16 compute lands each once per step, a split master with bf16 compute
    (a LoRA store keeps its adapters' masters plain and their gradients fp32)."""
    bf16 = hw.compute_dtype_bytes == 2
    return ("bf16" if bf16 and plan.lands_once() and shape.frozen_base is None else "fp32",
            "split" if bf16 and shape.frozen_base is None else "plain")


def optimizer_lines(shape: ModelShape, hw: HardwareProfile, plan: Plan) -> list[str]:
    """Per moments format of ``plan``: the host optimizer's configuration, the rate it is priced
    at and where that rate comes from (a preset's tagged assumption, or the profile), and its
    seconds per step: so the optimizer's share of a prediction can be traced to a measurement."""
    units = shape.unit_names()
    moments = plan.moments or ["fp32"] * len(units)
    grad, master = run_form(shape, hw, plan)
    host = PRESET_HOSTS.get(hw.name)
    lines = []
    for m in ("fp32", "8bit"):
        params = sum(shape.trainable_params(u) for u, mu in zip(units, moments) if mu == m)
        if not params:
            continue
        rate_gparam_s = (hw.optimizer_params_per_s if m == "fp32" else hw.optimizer_8bit_params_per_s) / 1e9
        name = config_name(m, grad, master)
        if host is not None and abs(host.rate_gparam_s(m, *GPU_RUN) - rate_gparam_s) <= 1e-9 * rate_gparam_s:
            priced, why = config_name(m, *GPU_RUN), host.describe(m, *GPU_RUN)
            if priced != name:
                why += (f"; this plan's form is {name}: {host.rate_gparam_s(m, grad, master):.2f} Gparam/s "
                        f"under the same assumption")
            name = priced
        else:
            name, why = f"{m} moments", f"from the profile {hw.name!r}: `layerwise calibrate` measures the run's form"
        lines.append(f"optimizer {name}: {rate_gparam_s:.2f} Gparam/s ({why}); {moments.count(m)} units, "
                     f"{params / 1e9:.2f}B params: {params / (rate_gparam_s * 1e9):.2f} s per step")
    return lines


def print_scaling(points: Sequence[ScalingPoint], global_batch: int, seq_len: int) -> None:
    reduce = points[0].topology.grad_reduce
    print(f"data parallel, predicted: global batch {global_batch} x {seq_len} tokens, the plan's tiers on every "
          f"GPU, gradients summed on the {reduce}; speedup vs 1 GPU on the same batch")
    cells = []
    for pt in points:
        t, p = pt.topology, pt.plan
        busy = pt.busy_fractions()
        second = sorted(busy, key=lambda k: -busy[k])[1]
        fits = "" if pt.sim.fits else f"  DOES NOT FIT: {', '.join(pt.sim.over_capacity())}"
        cells.append([str(t.world_size), str(t.nodes), f"{p.micro_batch_size} x {p.num_micro_batches}",
                      f"{pt.step_s:.3f}", f"{pt.tokens_per_s:,.0f}", f"{pt.speedup:.2f}", f"{pt.efficiency:.2f}",
                      f"{pt.bound} {busy[pt.bound]:.0%} (then {second} {busy[second]:.0%}){fits}"])
    header = ["GPUs", "nodes", "mbs x n", "step s", "tokens/s", "speedup", "eff", "bound (busy share of the step)"]
    for line in format_table(header, cells, left=(-1,)):
        print(line)
