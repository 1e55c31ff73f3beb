"""``xmlgen validate``: would libvirt accept this domain's hostdevs as we mean them?"""

from __future__ import annotations

import click

from launcher_hook.domain import parse_domain
from launcher_hook.validate import SchemaNotFound, hostdev_schema, validate_domain
from xmlgen.io import fail, max_input_bytes_option, read_input, user_errors


@click.command()
@click.argument("source", metavar="FILE|-")
@max_input_bytes_option
@user_errors
def validate(source: str, max_input_bytes: int) -> None:
    """Check every <hostdev> against libvirt's RNG schema, its alias (ua- prefix, characters, unique) and that
    no two hostdevs pass the same device. Prints one problem per line and exits 1 if there is any."""
    parsed = parse_domain(read_input(source, "domain XML", max_input_bytes), max_input_bytes)
    try:
        schema = hostdev_schema()
    except SchemaNotFound as exc:
        fail(str(exc))
        return
    problems = validate_domain(parsed.root, schema)
    for problem in problems:
        click.echo(problem)
    if problems:
        raise SystemExit(1)
    count = len(parsed.root.findall("devices/hostdev"))
    click.echo(f"ok: {count} hostdev{'s' if count != 1 else ''} valid")
