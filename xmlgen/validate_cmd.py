"""``xmlgen validate``: would libvirt accept this domain's hostdevs as we mean them?

Exit codes: 0 when libvirt would accept every hostdev as written (warnings may be printed), 1 when there is
at least one error, and 1 with ``error: …`` on stderr when the domain cannot be checked (unreadable, not
XML, libvirt's schemas missing); 2 for a usage mistake (click's own).
"""

from __future__ import annotations

import click

from launcher_hook.domain import parse_domain
from launcher_hook.validate import SchemaNotFound, hostdev_schema, is_live, review_domain
from xmlgen.io import fail, max_input_bytes_option, read_input, user_errors


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


@click.command()
@click.argument("source", metavar="FILE|-")
@click.option(
    "--live/--config",
    "live",
    default=None,
    help="Read the domain as live XML (virsh dumpxml of a running domain: libvirt's own aliases such as "
    "hostdev0 are fine) or as a configuration (hostdev aliases must start with ua-). Default: live when "
    "<domain> has an id= attribute, as only live XML has.",
)
@max_input_bytes_option
@user_errors
def validate(source: str, live: bool | None, max_input_bytes: int) -> None:
    """Check every <hostdev> (pci, mdev, usb, scsi, scsi_host) as libvirt would: its RNG schema, numbers as
    libvirt reads them, aliases, and the domain rules of libvirt's QEMU driver (display='on' needs
    <graphics>, one ramfb='on', no source twice). One finding per line, 'error:' or 'warning:'; exit 0 when
    there is no error, 1 otherwise."""
    parsed = parse_domain(read_input(source, "domain XML", max_input_bytes), max_input_bytes)
    try:
        schema = hostdev_schema()
    except SchemaNotFound as exc:
        fail(str(exc))
        return
    live = is_live(parsed.root) if live is None else live
    problems = review_domain(parsed.root, schema, live=live)
    for problem in problems:
        click.echo(problem)
    errors = sum(problem.is_error for problem in problems)
    warnings = len(problems) - errors
    kind = "live XML" if live else "configuration"
    if errors:
        click.echo(f"invalid: {_plural(errors, 'error')}, {_plural(warnings, 'warning')} ({kind})")
        raise SystemExit(1)
    count = len(parsed.root.findall("devices/hostdev"))
    suffix = f", {_plural(warnings, 'warning')}" if warnings else ""
    click.echo(f"ok: {_plural(count, 'hostdev')} valid ({kind}){suffix}")
