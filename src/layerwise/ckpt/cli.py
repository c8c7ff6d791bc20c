"""``layerwise ckpt``: ``ls``, ``show``, ``verify`` (exit 1 on any fault), ``gc``; ``merge`` is
added by ``layerwise.interop.cli``. ``--json`` prints exactly one JSON object; a ``layerwise
train`` out_dir is accepted as well as its ``ckpt/`` run."""

from __future__ import annotations

import argparse
import json
import sys

from ..util.cli import command_group
from ..util.units import human_bytes
from .errors import CheckpointError
from .run_dir import RunDir
from .resolve import composite_text, open_run_step


RUN_HELP = ("a `layerwise train` out_dir, or a checkpoint run directory (the out_dir's ckpt/, or "
            "the directory given to Checkpointer)")


def register(subparsers: argparse._SubParsersAction) -> None:
    sub = command_group(
        subparsers, "ckpt", help="inspect, verify, clean and merge layer-wise checkpoints",
        description="Layer-wise checkpoint runs: list steps, show composites, verify, gc, merge.",
    )

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("run", help=RUN_HELP)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(func=func)
        return p

    command("ls", "committed steps with bytes written and policy", cmd_ls)
    command("show", "per group of one step: source step, staleness, bytes", cmd_show).add_argument(
        "--step", type=int, default=None, help="step to resolve (default: newest)")
    command("verify", "check checksums and completeness; exit 1 on any fault", cmd_verify)
    command("gc", "keep the newest K steps; delete the rest and unreferenced blobs", cmd_gc).add_argument(
        "--keep", type=int, required=True, help="number of newest committed steps to keep")


def _emit(args: argparse.Namespace, obj: dict, text: str) -> None:
    print(json.dumps(obj, sort_keys=True) if args.json else text)


def _fail(args: argparse.Namespace, e: Exception) -> int:
    if args.json:
        print(json.dumps({"ok": False, "error": str(e)}))
    else:
        print(f"layerwise ckpt: error: {e}", file=sys.stderr)
    return 1


def cmd_ls(args: argparse.Namespace) -> int:
    store = RunDir.open(args.run)
    rows = []
    try:
        for step in store.committed_steps():
            m = store.read_manifest(step)
            rows.append({
                "step": step, "policy": m.get("policy"), "bytes_written": m.get("bytes_written"),
                "bytes_total": sum(e["nbytes"] for e in m["groups"].values()),
                "groups_written": len(m.get("groups_written", [])), "groups": len(m["groups"]),
            })
    except CheckpointError as e:
        return _fail(args, e)
    lines = [f"{'step':>10}  {'policy':<8} {'written':>12} {'composite':>12}  groups written"]
    for r in rows:
        lines.append(f"{r['step']:>10}  {str(r['policy']):<8} {human_bytes(r['bytes_written']):>12} "
                     f"{human_bytes(r['bytes_total']):>12}  {r['groups_written']}/{r['groups']}")
    if not rows:
        lines = ["no committed steps"]
    _emit(args, {"run": str(store.root), "latest": store.latest_step(), "steps": rows}, "\n".join(lines))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        rs = open_run_step(args.run, args.step)
        save_index = int(rs.manifest.get("save_index", 0))
        groups = []
        for g, e in rs.entries.items():
            saved_index = rs.manifest["groups"][g].get("saved_index")
            groups.append({
                "group": g, "saved_step": e.saved_step, "written_step": e.written_step,
                "staleness_steps": rs.step - e.saved_step,
                "staleness_checkpoints": None if saved_index is None else save_index - int(saved_index),
                "nbytes": e.nbytes, e.hash_name: e.digest, "blob": e.blob,
                **({"shards": [s["blob"] for s in e.shards]} if e.shards is not None else {}),
            })
    except CheckpointError as e:
        return _fail(args, e)
    obj = {"run": str(rs.run_dir), "step": rs.step, "requested_step": rs.requested_step,
           "policy": rs.policy, "bytes_total": sum(g["nbytes"] for g in groups), "groups": groups}
    lines = [f"step {rs.step}" + (f" (newest committed <= {rs.requested_step})"
                                  if rs.requested_step != rs.step else "") + f", policy {rs.policy}",
             f"{'group':<14} {'saved at':>10} {'stale steps':>12} {'stale ckpts':>12} {'bytes':>12}"]
    for g in groups:
        lines.append(f"{g['group']:<14} {g['saved_step']:>10} {g['staleness_steps']:>12} "
                     f"{str(g['staleness_checkpoints']):>12} {human_bytes(g['nbytes']):>12}")
    older = rs.older_groups()
    obj["older_groups"] = older
    note = composite_text(rs.step, older, len(groups))
    lines.append(note or f"every group is step {rs.step}'s own")
    _emit(args, obj, "\n".join(lines))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = RunDir.open(args.run)
    rep = store.verify()
    if not rep.steps and rep.ok:
        rep.warnings.append("no committed steps")
    lines = [f"{'OK' if rep.ok else 'FAULTY'}: {len(rep.steps)} step(s), {rep.blobs_checked} blob(s) checked"]
    lines += [f"fault: {f}" for f in rep.faults] + [f"warning: {w}" for w in rep.warnings]
    _emit(args, {"run": str(store.root), **rep.to_json()}, "\n".join(lines))
    return 0 if rep.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = RunDir.open(args.run)
    rep = store.gc(args.keep)
    _emit(args, {"run": str(store.root), **rep.to_json()},
          f"kept steps {rep.kept_steps}; dropped {len(rep.dropped_steps)} step(s) and "
          f"{rep.removed_blobs} blob(s), freed {human_bytes(rep.freed_bytes)}")
    return 0
