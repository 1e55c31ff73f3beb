"""``xmlgen doctor``: why does this node not give VMs its GPUs? One line per check, with the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from plugin.config import load_config
from xmlgen.doctor import DEFAULT_KUBELET_DIR, Status, run_checks
from xmlgen.io import user_errors

_COLOURS = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "red"}


@click.command()
@click.option("--host-root", metavar="DIR", help="Where the node's / is (sysfs under DIR/sys). Default: /.")
@click.option("--pci-ids", metavar="FILE", help="pci.ids to name devices by (as xmlgen discover).")
@click.option("--config", "config_file", metavar="FILE", help="Plugin configuration, YAML or JSON.")
@click.option("--kubelet-dir", default=DEFAULT_KUBELET_DIR, show_default=True, help="Under the host root.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@user_errors
def doctor(
    host_root: str | None, pci_ids: str | None, config_file: str | None, kubelet_dir: str, as_json: bool
) -> None:
    """Check the IOMMU, vfio-pci, each NVIDIA GPU's driver and IOMMU group, /dev/vfio, pci.ids and the
    kubelet's device-plugin directory. OK/WARN/FAIL per check with the fix; exit 1 on any FAIL."""
    config = load_config(Path(config_file) if config_file else None, os.environ, host_root=host_root, pci_ids=pci_ids)
    checks = run_checks(config, kubelet_dir=kubelet_dir)
    if as_json:
        click.echo(json.dumps([check.to_json() for check in checks], indent=2))
    else:
        width = max(len(check.name) for check in checks)
        for check in checks:
            status = click.style(f"{check.status.value:<4}", fg=_COLOURS[check.status])
            click.echo(f"{status}  {check.name:<{width}}  {check.detail}")
            if check.fix:
                click.echo(f"{'':4}  {'':<{width}}  fix: {check.fix}")
    if any(check.status is Status.FAIL for check in checks):
        raise SystemExit(1)
