"""The command line of the GPU check: its options, the stages in order, the summary table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import __doc__ as PACKAGE_DOC
from .cuda_tests import run_cuda_tests
from .first import FirstSizes, run_copy_bandwidth, run_layer_check, run_pinned_arena, run_tiny_steps
from .lora import LORA, run_lora
from .machine import REPO, Dev, device_facts, host_ram, set_alloc_conf
from .model import LAYER_MAJOR, PACKED, Large, candidate_plans, run_model
from .nvme_state import run_nvme_state
from .plans import make_batches, run_layer_major, run_plan, run_simulator
from .probes import run_calibration, run_optimizer, run_planner
from .report import SCHEMA_ID, Report, hidden_modules
from .schema import render_markdown
from .store import run_store
from .wheels import WHEEL_STATUSES, run_wheels

FIRST_CONTACT = ("device", "layer_check", "tiny_steps", "nvme_state", "pinned_arena", "copy_bandwidth")
PLAN_NAMES = ("planner", "every-1", "every-4", "keep-all-host", "packed", "layer-major")
NEEDS = {"calibration": ("model",), "optimizer": ("model",), "planner": ("model",), "store": ("model",),
         "plan": ("model", "store", "planner"), "simulator": ("model",)}
"""What a selected stage brings along (``--stages``)."""
STAGES = ("wheels",) + FIRST_CONTACT + ("cuda_tests", "model", "calibration", "optimizer", "planner", "store",
                                        "plan", "simulator")

DEFAULTS = dict(model="llama3-8b", layers=16, seq_len=4096, micro_batch_size=8, steps=2, optim_layers=4,
                optim_rounds=7, milp_budget_s=6.0)
DRY_DEFAULTS = dict(model="llama-debug", layers=4, seq_len=32, micro_batch_size=2, steps=1, optim_layers=1,
                    optim_rounds=1, milp_budget_s=0.5)
DRY_HOST_BUDGET_GB = 137.4
"""A dry run's host budget when none is given: 128 GiB, as the Makefile's ``GPU_HOST_BUDGET_GB``."""
DEFAULT_WHEELS = "highspy,blake3"
"""What ``make gpu-wheels`` brings (the Makefile's ``GPU_WHEELS`` passes its own list)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=PACKAGE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check.json", help="JSON file to write (default gpu-check.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="every stage on the CPU (asynchronous CPU backend, tiny model), all but the CUDA calls")
    ap.add_argument("--host-budget-gb", type=float, default=None,
                    help="host RAM in GB (1e9 bytes) for the store's and the planner's RAM checks; required "
                         "on a GPU (MemTotal/MemAvailable are not used)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="time budget: no stage starts when less than its estimate is left (default 360)")
    ap.add_argument("--stages", default="", help=f"comma-separated subset of {','.join(STAGES)} "
                                                  "(with what they need)")
    ap.add_argument("--hide-modules", default="",
                    help="comma-separated packages to make unimportable, here and in the tests' pytest "
                         "(as on a machine without them)")
    ap.add_argument("--print-schema", action="store_true", help="print the JSON schema as markdown and exit")
    w = ap.add_argument_group("wheels (stage `wheels`)")
    w.add_argument("--wheel-dir", default=None,
                   help="the .whl files to install (default .whl/ of the checkout; a dry run: none, unless given)")
    w.add_argument("--wheel-site", default="/tmp/layerwise-gpu-site", help="pip --target (default %(default)s)")
    w.add_argument("--wheels", default=DEFAULT_WHEELS,
                   help="expected wheels, comma- or space-separated, `name` or `name==version` (%(default)s)")
    g = ap.add_argument_group("large model (defaults: a dry run's in brackets)")
    g.add_argument("--model", help="flavor whose widths are used (llama3-8b [llama-debug])")
    g.add_argument("--layers", type=int, help="decoder layers, lowered to fit the host budget (16 [4])")
    g.add_argument("--seq-len", type=int, help="4096 [32]")
    g.add_argument("--micro-batch-size", type=int, help="8 [2]")
    g.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step (1)")
    g.add_argument("--moments", choices=("8bit", "fp32"), default="8bit", help="optimizer moments of every unit")
    g.add_argument("--steps", type=int, help="timed steps per plan, after one warm-up step (2 [1])")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-profile", dest="profile", action="store_false", help="no profiled step per plan")
    g.add_argument("--trace-dir", default=None, help="also keep each plan's chrome trace here")
    g.add_argument("--calibrate-quick", action="store_true", help="calibrate --quick")
    g.add_argument("--optim-layers", type=int, help="decoder layers' worth of params for the optimizer (4 [1])")
    g.add_argument("--optim-rounds", type=int, help="7 [1]")
    g.add_argument("--milp-budget-s", type=float, help="HiGHS time of the planner's search (6 [0.5])")
    t = ap.add_argument_group("CUDA tests")
    t.add_argument("--cuda-tests-timeout-s", type=float, default=120.0, help="all CUDA tests (120)")
    t.add_argument("--cuda-test-timeout-s", type=float, default=90.0, help="one test, with pytest-timeout (90)")
    t.add_argument("--reserve-after-tests-s", type=float, default=200.0,
                   help="budget kept for the large stages when the tests' timeout is set (200)")
    args = ap.parse_args(argv)
    for key, value in (DRY_DEFAULTS if args.dry_run else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.host_budget_gb is None and args.dry_run:
        args.host_budget_gb = DRY_HOST_BUDGET_GB
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stages {unknown}; choose from {','.join(STAGES)}")
    args.hide_modules = [s.strip() for s in args.hide_modules.split(",") if s.strip()]
    args.wheels = [s for s in args.wheels.replace(",", " ").split() if s]
    if args.wheel_dir is None and not args.dry_run:
        args.wheel_dir = str(REPO / ".whl")
    return args


def selected_stages(names: list[str]) -> set[str] | None:
    """The stages asked for with those they need; None: all."""
    return set(names).union(*(NEEDS.get(n, ()) for n in names)) if names else None


def run_stages(report: Report, args: argparse.Namespace) -> None:
    res = report.result
    dev = Dev(args.dry_run)
    sizes = FirstSizes.dry() if args.dry_run else FirstSizes()
    report.stage("wheels", 5, lambda d: wheels_stage(args, d))
    report.stage("device", 10, lambda d: device_facts(dev, d))
    report.stage("layer_check", 15, lambda d: run_layer_check(dev, sizes, d))
    report.stage("tiny_steps", 15, lambda d: run_tiny_steps(dev, sizes, d))
    report.stage("nvme_state", 20, lambda d: run_nvme_state(dev, sizes, Path(args.out), d))
    report.stage("pinned_arena", 10, lambda d: run_pinned_arena(dev, sizes, d))
    report.stage("copy_bandwidth", 10, lambda d: run_copy_bandwidth(dev, sizes, d))
    res["first_contact_s"] = round(report.elapsed_s(), 3)

    timeout = max(30.0, min(args.cuda_tests_timeout_s, report.left_s() - args.reserve_after_tests_s))
    lg = Large(dev, args.model, int(args.host_budget_gb * 1e9), args.micro_batch_size, args.seq_len,
               args.micro_batches, args.moments)
    tests_ram = lg.host_available_bytes()
    report.stage("cuda_tests", 30, lambda d: run_cuda_tests(d, args.dry_run, args.hide_modules, timeout,
                                                            args.cuda_test_timeout_s, tests_ram))

    report.stage("model", 10, lambda d: run_model(lg, args.layers, d))
    report.stage("calibration", 25, lambda d: run_calibration(lg, args.calibrate_quick, d), needs=("model",))
    report.stage("optimizer", 20, lambda d: run_optimizer(lg, args.optim_layers, args.optim_rounds, d),
                 needs=("model",))
    report.stage("planner", 10 + args.milp_budget_s, lambda d: run_planner(lg, args.milp_budget_s, d),
                 needs=("model",))
    # small (one layer) and before the large store takes the host: the budget never cuts it
    report.stage(f"plan:{LORA}", 45, lambda d: run_lora(lg, args, d), data_path=("plans", LORA), needs=("model",))
    report.stage("store", 60, lambda d: run_store(lg, args.seed, d), needs=("model",))
    if lg.shape is not None:
        plans = candidate_plans(lg)
        res["plan_order"] = [{"plan": n, "predicted_peak_bytes": peak} for n, p, peak in plans if p is not None]
    else:
        plans = [(n, None, 0) for n in PLAN_NAMES]
    batches = make_batches(lg, args.seed + 1) if lg.store is not None else None
    estimate = 60.0
    for name, plan, _ in plans:
        needs = ("store", "planner") if name == "planner" else ("store",)
        if name == LAYER_MAJOR:  # a store of its own (bf16 gradients), built where the last one was
            report.stage(f"plan:{name}", estimate + 60, lambda d, p=plan: run_layer_major(lg, p, args, d),
                         data_path=("plans", name), needs=needs)
            continue
        mine = batches
        if name == PACKED and lg.store is not None:
            mine = make_batches(lg, args.seed + 2, packed=True)
        report.stage(f"plan:{name}", estimate, lambda d, n=name, p=plan, b=mine: run_plan(
            lg, n, p, b, args.steps, args.lr, args.profile, args.trace_dir, d),
            data_path=("plans", name), needs=needs)
        if report.status_of(f"plan:{name}") == "ok":  # the next plan needs about as long, a bit more
            estimate = 1.2 * res["stages"][f"plan:{name}"]["wall_s"]
    lg.store = batches = None
    dev.clean()
    report.stage("simulator", 5, lambda d: run_simulator(lg, d), needs=("model",))


def wheels_stage(args: argparse.Namespace, data: dict) -> None:
    """Install and report the wheels (a dry run without ``--wheel-dir``: none looked for)."""
    if args.wheel_dir is None:
        data.update(wheel_dir=None, site=None, expected=[], wheels={}, counts=dict.fromkeys(WHEEL_STATUSES, 0))
        return
    run_wheels(Path(args.wheel_dir), Path(args.wheel_site), args.wheels, data)


def no_gpu(reason: str) -> int:
    print(f"gpu-check: no GPU here ({reason}); nothing to check.", file=sys.stderr)
    print(json.dumps({"schema": SCHEMA_ID, "status": "no_cuda", "reason": reason}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_schema:
        print(render_markdown(), end="")
        return 0
    set_alloc_conf()
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return no_gpu(f"torch is not importable: {type(e).__name__}: {e}")
    if not args.dry_run and not torch.cuda.is_available():
        return no_gpu(f"torch {torch.__version__} sees no CUDA device")
    if args.host_budget_gb is None:
        print("gpu-check: give --host-budget-gb, the machine's RAM in GB (`make gpu-check` passes "
              "GPU_HOST_BUDGET_GB); MemTotal/MemAvailable are not used", file=sys.stderr)
        return 2
    if str(REPO / "src") not in sys.path:
        sys.path.insert(0, str(REPO / "src"))
    report = Report(Path(args.out), args.budget_s, vars(args), args.dry_run, selected_stages(args.stages))
    report.result["host_ram"] = host_ram(int(args.host_budget_gb * 1e9))
    report.save()
    threads = torch.get_num_threads()
    if args.dry_run:  # tiny tensors: with more threads than idle cores every op waits for the others
        torch.set_num_threads(1)
    try:
        with hidden_modules(args.hide_modules):
            run_stages(report, args)
    finally:
        torch.set_num_threads(threads)
    status = report.finish(FIRST_CONTACT)
    print(json.dumps(report.result, indent=2, default=str))
    print(summary(report.result), file=sys.stderr)  # stdout holds the one JSON object
    return 0 if status == "ok" else 1


def _fmt(x: Any, fmt: str) -> str:
    width = int(fmt.split(".")[0])
    return format(x, fmt) if isinstance(x, (int, float)) else "-".rjust(width)


def summary(result: dict[str, Any]) -> str:
    """A short table to read at the end of the output."""
    lines = [f"gpu-check: status {result['status']} in {result.get('wall_s', 0):.0f} s "
             f"(first contact {result.get('first_contact_s', 0):.0f} s); failed {result.get('failed_stages')}, "
             f"skipped {result.get('skipped_stages')}"]
    for name, rec in result["stages"].items():
        note = rec["error"] or rec["reason"] or ""
        lines.append(f"  {name:<20}{rec['status']:<9}{_fmt(rec['wall_s'], '8.1f')} s  {note[:100]}")
    t = result.get("cuda_tests")
    if t:
        lines.append(f"cuda tests: {t.get('passed')} passed, {t.get('failed')} failed, {t.get('errors')} errors, "
                     f"{t.get('skipped')} skipped, {len(t.get('collection_errors') or [])} not collected")
    sims: dict[str, dict[str, Any]] = {}
    for run in (result.get("simulator") or {}).get("runs", []):
        sims.setdefault(run["plan"], {})[run["profile"]] = run
    lines.append(f"{'plan':<14}{'tok/s':>9}{'TFLOPS':>8}{'step s':>8}{'sim s':>8}{'res/pred':>9}"
                 f"{'H2D GB/s':>9}{'D2H GB/s':>9}{'overlap':>8}")
    for name, r in (result.get("plans") or {}).items():
        sim = sims.get(name, {})
        sim_s = next((sim[p]["step_s"] for p in ("calibrated-shape", "calibrated", "h200") if p in sim), None)
        lines.append(f"{name:<14}{_fmt(r.get('tokens_per_s'), '9.0f')}{_fmt(r.get('tflops'), '8.1f')}"
                     f"{_fmt(r.get('step_s'), '8.3f')}{_fmt(sim_s, '8.3f')}"
                     f"{_fmt(r.get('reserved_over_predicted'), '9.3f')}{_fmt(r.get('h2d_gbps'), '9.1f')}"
                     f"{_fmt(r.get('d2h_gbps'), '9.1f')}{_fmt(r.get('copy_overlap_fraction'), '8.2f')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
