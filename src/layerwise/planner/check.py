"""Independent feasibility check of a simulated plan (``docs/planner.md``, "Feasibility checker").

It trusts neither the simulator's peaks nor the MILP's capacity rows: it recomputes every tier's
occupancy from the timeline and checks capacity, lane exclusivity, weights and boundaries present
for every op, NVMe reads after writes, and copies after the previous step's update."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..plan.shape import ModelShape
from .hardware import HardwareProfile
from ..plan.program import OpKind
from .trace import LANES, RESIDENT_SLOT, SimResult

EPS = 1e-9


@dataclass
class CheckReport:
    ok: bool
    violations: list[str] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    """Recomputed peak bytes per tier (host includes the store)."""


def _occupancy_peak(starts: np.ndarray, ends: np.ndarray, nbytes: np.ndarray) -> tuple[int, float]:
    """Max over allocation instants t of sum(bytes of allocations with start <= t < end)."""
    if len(starts) == 0:
        return 0, 0.0
    so = np.argsort(starts, kind="stable")
    s_sorted, s_cum = starts[so], np.cumsum(nbytes[so])
    eo = np.argsort(ends, kind="stable")
    e_sorted, e_cum = ends[eo], np.cumsum(nbytes[eo])
    t = s_sorted
    added = s_cum[np.searchsorted(s_sorted, t, side="right") - 1]
    k = np.searchsorted(e_sorted, t, side="right")
    freed = np.where(k > 0, e_cum[np.maximum(k - 1, 0)], 0)
    live = added - freed
    j = int(np.argmax(live))
    return int(live[j]), float(t[j])


def check(sim: SimResult, shape: ModelShape, hw: HardwareProfile) -> CheckReport:
    """Every violation found in ``sim``'s trace (none: ``ok``), and the recomputed peaks."""
    if not sim.allocs or not sim.op_log:
        raise ValueError("check needs a simulation with its trace (simulate(..., keep_trace=True))")
    v: list[str] = []
    try:
        sim.plan.validate(shape.num_layers)
    except ValueError as e:
        v.append(f"plan: {e}")
    peaks = _capacity(sim, hw, v)
    v += _lanes_overlap(sim, hw)
    v += _op_inputs(sim)
    v += _offload_order(sim)
    v += _update_order(sim, shape)
    return CheckReport(not v, v, peaks)


def _capacity(sim: SimResult, hw: HardwareProfile, v: list[str]) -> dict[str, int]:
    """Each tier's peak at every allocation instant against its capacity (host: with the store);
    appends to ``v``, returns the peaks."""
    caps = {"device": hw.device_cap_bytes, "host": hw.host_cap_bytes, "nvme": hw.nvme_capacity_bytes}
    base = {"device": 0, "host": sim.host_store_bytes, "nvme": 0}
    peaks = {}
    for tier in caps:
        al = [a for a in sim.allocs if a.tier == tier and a.end > a.start]
        starts = np.array([a.start for a in al], dtype=float)
        ends = np.array([a.end for a in al], dtype=float)
        nb = np.array([a.nbytes for a in al], dtype=np.int64)
        if np.isinf(ends).any():
            v.append(f"{tier}: {int(np.isinf(ends).sum())} allocations never freed")
            ends = np.where(np.isinf(ends), starts.max(initial=0) + 1e9, ends)
        peak, at = _occupancy_peak(starts, ends, nb)
        peaks[tier] = peak + base[tier]
        if peaks[tier] > caps[tier]:
            v.append(f"{tier}: {peaks[tier]} bytes live at t={at:.6f}s > capacity {caps[tier]}")
    return peaks


def _lanes_overlap(sim: SimResult, hw: HardwareProfile) -> list[str]:
    """No lane (a synchronous machine's copies and host work share the compute lane) runs two
    things at once: the first overlap per lane."""
    v = []
    phys = {k: ("compute" if hw.synchronous and k in ("h2d", "d2h", "host", "optimizer") else k) for k in LANES}
    by_lane: dict[str, list] = defaultdict(list)
    for iv in sim.intervals:
        by_lane[phys[iv.lane]].append(iv)
    for lane, ivs in by_lane.items():
        ivs.sort(key=lambda x: (x.start, x.end))
        for a, b in zip(ivs, ivs[1:]):
            if b.start < a.end - EPS:
                v.append(f"lane {lane}: '{a.label}' [{a.start:.6f},{a.end:.6f}] overlaps '{b.label}' at {b.start:.6f}")
                break
    return v


def _op_inputs(sim: SimResult) -> list[str]:
    """What each compute op needs is there: its weights copied into its slot before it starts
    and not overwritten while it runs, its input boundary or kept internals on the device for
    its whole run, fetched after they were copied out."""
    plan, v = sim.plan, []
    allocs_by_label: dict[str, list] = defaultdict(list)
    for a in sim.allocs:
        if a.tier == "device":
            key = a.label.split(" (")[0]
            allocs_by_label[key].append(a)
    copies = _copies(sim)

    def covered(key: str, s: float, e: float) -> bool:
        return any(a.start <= s + EPS and a.end >= e - EPS for a in allocs_by_label.get(key, ()))

    slot_copies: dict[int, list] = defaultdict(list)  # weight slot -> copies into it, by start
    refreshes: dict[tuple[int, str], float] = {}  # (step, resident unit) -> when its refresh ended
    for iv in sim.intervals:
        if iv.label.startswith("w "):
            unit, slot = iv.label[2:].rsplit(" @", 1)
            if slot == RESIDENT_SLOT:
                refreshes[(iv.step, unit)] = iv.end
            else:
                slot_copies[int(slot)].append(iv)
    for ivs in slot_copies.values():
        ivs.sort(key=lambda c: c.start)
    for op in sim.op_log:
        s, e = op["start"], op["end"]
        for u, slot in zip(op["units"], op["slots"]):
            into = slot_copies.get(slot, ())
            last = [c for c in into if c.start <= s + EPS]
            if not last or last[-1].label.split(" @")[0] != f"w {u}" or last[-1].end > s + EPS:
                v.append(f"{op['kind']} {op['index']} (step {op['step']}, mb {op['mb']}): weights of {u} "
                         f"not in slot {slot} when it starts")
            elif any(s + EPS < c.start < e - EPS for c in into):
                v.append(f"{op['kind']} {op['index']}: slot {slot} overwritten while it runs")
        for u in op.get("resident", ()):
            if refreshes.get((op["step"], u), float("inf")) > s + EPS:
                v.append(f"{op['kind']} {op['index']} (step {op['step']}, mb {op['mb']}): resident weights of {u} "
                         "not refreshed this step before it starts")
        if op["kind"] in (OpKind.LAYER_BWD, OpKind.RECOMPUTE_LAYER):
            i = op["index"]
            if not covered(f"boundary {i}", s, e):
                v.append(f"{op['kind']} {i} (step {op['step']}, mb {op['mb']}): input boundary {i} not on device")
        if op["kind"] == OpKind.LAYER_BWD_KEPT:
            i = op["index"]
            if not covered(f"internals {i}", s, e):
                v.append(f"layer_bwd_kept {i} (step {op['step']}, mb {op['mb']}): internals of layer {i} not on device")
            if plan.internal_tiers[i] == "host" and not any(
                    c.end <= s + EPS for c in copies.get(f"{OpKind.FETCH_INTERNALS} L{i}", ())):
                v.append(f"layer_bwd_kept {i}: internals of layer {i} not fetched before use")
        if op["kind"] == OpKind.LAYER_BWD and plan.boundary_tiers[op["index"]] in ("host", "nvme"):
            i = op["index"]
            if not any(c.end <= s + EPS for c in copies.get(f"{OpKind.FETCH} b{i}", ())):
                v.append(f"layer_bwd {i}: boundary {i} not fetched before use")
    return v


def _copies(sim: SimResult) -> dict[str, list]:
    """Lane intervals by label."""
    copies: dict[str, list] = defaultdict(list)
    for iv in sim.intervals:
        copies[iv.label].append(iv)
    return copies


def _offload_order(sim: SimResult) -> list[str]:
    """The offload chain in order, k-th with k-th: offload -> fetch; NVMe: offload -> write ->
    read -> fetch."""
    plan, v, copies = sim.plan, [], _copies(sim)
    for i, tier in enumerate(plan.boundary_tiers):
        pairs = [("offload", OpKind.FETCH)] if tier == "host" else (
            [("offload", "nvme write"), ("nvme write", "nvme read"), ("nvme read", OpKind.FETCH)]
            if tier == "nvme" else [])
        for first, then in pairs:
            xs = sorted(copies.get(f"{first} b{i}", ()), key=lambda c: c.start)
            ys = sorted(copies.get(f"{then} b{i}", ()), key=lambda c: c.start)
            if not ys and plan.internal_tiers[i] != "recompute" and then in (OpKind.FETCH, "nvme read"):
                continue  # its layer keeps its internals and no recompute starts here: never read
            if len(xs) != len(ys):
                v.append(f"boundary {i}: {len(xs)} '{first}' but {len(ys)} '{then}'")
                continue
            for x, y in zip(xs, ys):
                if y.start < x.end - EPS:
                    v.append(f"boundary {i}: '{then}' starts at {y.start:.6f} before '{first}' ends at {x.end:.6f}")
                    break
    return v


def _update_order(sim: SimResult, shape: ModelShape) -> list[str]:
    """A unit's optimizer update of step s ends before its weights are copied in step s+1 (a
    frozen unit, a LoRA run's embedding and head, has no update)."""
    updates = {(iv.step, iv.label[len("update "):]): iv.end for iv in sim.intervals if iv.label.startswith("update ")}
    for iv in sim.intervals:
        if iv.label.startswith("w ") and iv.step > 0:
            unit = iv.label[2:].split(" @")[0]
            if not shape.trainable_params(unit):
                continue
            done = updates.get((iv.step - 1, unit))
            if done is None or iv.start < done - EPS:
                return [f"step {iv.step}: weights of {unit} copied before their update finished"]
    return []
