"""``python -m tests.realnode prepare|run|scenario`` (scripts/realnode.sh): the real-kernel harness from the shell."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.realnode.assets import AssetError, ensure
from tests.realnode.guest import DEFAULT_DEVICES, DEVICE_SETS, BootError, boot
from tests.realnode.scenarios import MODULES, run_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/realnode.sh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="resolve, download, build and cache the guest (fast when cached)")
    run = commands.add_parser("run", help="boot a guest node and run a shell command in it (host root read-only)")
    run.add_argument("--no-iommu", action="store_true", help="no intel-iommu device, intel_iommu=off")
    run.add_argument(
        "--devices", default=",".join(DEFAULT_DEVICES), help=f"comma-separated, of {', '.join(DEVICE_SETS)}"
    )
    run.add_argument("--results", type=Path, help="the guest's /tmp/realnode on the host (default: a temp dir)")
    run.add_argument("--timeout", type=float, default=120)
    run.add_argument("shell_command", help="run by /bin/sh inside the guest, in /tmp/realnode")
    scenario = commands.add_parser("scenario", help="run one of tests/realnode/inguest.py's scenarios")
    scenario.add_argument("name", choices=["node", "iommu_off"])
    scenario.add_argument("--results", type=Path)
    simulate = commands.add_parser(
        "simulate", help="the whole path in a guest node, step by step (stderr), the final domain (stdout)"
    )
    simulate.add_argument("--results", type=Path)
    args = parser.parse_args(argv)
    try:
        assets = ensure()
        if args.command == "prepare":
            print(assets.directory)
            return 0
        results = args.results or Path(tempfile.mkdtemp(prefix="realnode-"))
        if args.command == "run":
            devices = [name for name in args.devices.split(",") if name]
            result = boot(
                assets,
                args.shell_command + "\n",
                results,
                iommu=not args.no_iommu,
                devices=devices,
                modules=MODULES,
                timeout=args.timeout,
            )
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
            print(f"realnode: exit {result.rc} after {result.seconds:.1f} s; files in {results}", file=sys.stderr)
            return result.rc
        if args.command == "simulate":
            told = run_scenario(assets, "simulate", results)
            sys.stderr.write(told.boot.stderr)
            sys.stdout.write(told.boot.stdout)
            failed = told.boot.rc != 0 or told.observations.get("errors")
            print(f"realnode: {told.boot.seconds:.1f} s in the guest node; files in {results}", file=sys.stderr)
            return 1 if failed else 0
        done = run_scenario(assets, args.name, results, iommu=args.name != "iommu_off")
        print(json.dumps(done.observations, indent=2, sort_keys=True))
        print(f"realnode: {args.name} took {done.boot.seconds:.1f} s; files in {results}", file=sys.stderr)
        return 0 if not done.observations.get("errors") else 1
    except (AssetError, BootError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
