"""``layerwise calibrate``: measure this machine (through the engine's own paths) for the planner."""

from __future__ import annotations

import argparse

from .calibrate import calibrate


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Measure matmul throughput, copy bandwidth, disk write/read and host "
                                   "optimizer throughput; write a profile for `layerwise plan --hardware`.")
    c.add_argument("--out", default="profile.json", help="profile file to write (default profile.json)")
    c.add_argument("--quick", action="store_true", help="smaller measurements (seconds, less precise)")
    c.add_argument("--device", default="auto", help="cpu, cuda or auto")
    c.add_argument("--spill-dir", default=None, help="directory for the disk measurement (default: temp dir)")
    c.set_defaults(func=calibrate_command)


def calibrate_command(args: argparse.Namespace) -> int:
    profile = calibrate(quick=args.quick, device=args.device, spill_dir=args.spill_dir)
    profile.save(args.out)
    d = profile.to_dict()
    for k, v in d.items():
        print(f"{k:<28}{v}")
    print(f"wrote {args.out}")
    return 0
