"""``python -m tests.cluster up|down|status|logs|image|kubectl`` (scripts/cluster.sh): the cluster kit by hand."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tests.cluster import images, kit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster.sh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build the peers if needed (cached), start the one-node cluster, wait for it")
    up.add_argument(
        "--release",
        choices=sorted(kit.RELEASES.values()),
        default=kit.RELEASES["kube"],
        help="the Kubernetes release to run (default: %(default)s; 1.34 is the oldest deploy/dra claims)",
    )
    commands.add_parser("down", help="stop everything the kit started and remove what it made")
    commands.add_parser("status", help="the components' pids (null: not running)")
    logs = commands.add_parser("logs", help="the end of a component's log")
    logs.add_argument("component", choices=[*kit.COMPONENTS, "buildkitd"])
    logs.add_argument("-n", "--lines", type=int, default=50)
    commands.add_parser("image", help=f"build the project's image ({images.PROJECT_IMAGE}) into the cluster")
    kubectl = commands.add_parser("kubectl", help="the cluster's kubectl, as its admin")
    kubectl.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            (release,) = [peer for peer, name in kit.RELEASES.items() if name == args.release]
            kit.up(release=release)
            print(f"export KUBECONFIG={kit.STATE / 'admin.kubeconfig'}")
        elif args.command == "down":
            problems = kit.down()
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            return 1 if problems else 0
        elif args.command == "status":
            print(json.dumps(kit.status(), indent=2))
        elif args.command == "logs":
            print(kit.log_tail(args.component, args.lines))
        elif args.command == "image":
            peers = kit.build_peers()
            seconds = images.build_project_image(peers)
            print(f"{images.PROJECT_IMAGE} built in {seconds:.0f} s", file=sys.stderr)
        elif args.command == "kubectl":
            peers = kit.build_peers(("kube",))
            os.execv(
                str(kit.kubectl_path(peers)), ["kubectl", f"--kubeconfig={kit.STATE / 'admin.kubeconfig'}", *args.args]
            )
    except kit.ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
