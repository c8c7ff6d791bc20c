"""``layerwise calibrate``: measure this machine (through the engine's own paths) for the planner."""

from __future__ import annotations

import argparse

import torch

from .calibrate import calibrate
from .calibrate_host import optimizer_lines


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Measure matmul throughput, memory bandwidth, kernel launch, copy bandwidth, "
                                   "disk write/read, memory and the host path (gradient accumulation, optimizer, "
                                   "pinned refresh, gloo when asked); write a profile for `layerwise plan --hardware`.")
    c.add_argument("--out", default="profile.json", help="profile file to write (default profile.json)")
    c.add_argument("--quick", action="store_true", help="smaller measurements (seconds, less precise)")
    c.add_argument("--device", default="auto", help="cpu, cuda or auto")
    c.add_argument("--spill-dir", default=None, help="directory for the disk measurement (default: temp dir)")
    c.add_argument("--model", default=None, help="the run's model (flavor or HF model dir): size the host "
                                                 "probes to its largest layer")
    c.add_argument("--optimizer-threads", type=int, default=1,
                   help="the engine's optimizer threads (EngineConfig.optimizer_threads, default 1)")
    c.add_argument("--gloo", action="store_true", help="also measure gloo's reduce (data parallel on the host); "
                                                       "measured anyway when torch.distributed is initialised")
    c.set_defaults(func=calibrate_command)


def calibrate_command(args: argparse.Namespace) -> int:
    profile = calibrate(quick=args.quick, device=args.device, spill_dir=args.spill_dir, model=args.model,
                        optimizer_threads=args.optimizer_threads, gloo=args.gloo)
    profile.save(args.out)
    d = profile.to_dict()
    for k, v in d.items():
        print(f"{k:<28}{v}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    for line in optimizer_lines(profile, torch.device(device).type, args.optimizer_threads):
        print(line)
    print(f"wrote {args.out}")
    return 0
