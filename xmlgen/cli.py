"""The ``xmlgen`` command group. Commands are thin: each lives in its own module and calls library code.

Errors the user can fix (``InputError``) print ``error: …`` on stderr and exit 1 with nothing on stdout.
"""

from __future__ import annotations

import click

from schemas.clirun import run_cli
from xmlgen.discover_cmd import discover
from xmlgen.doctor_cmd import doctor
from xmlgen.render_cmd import render
from xmlgen.simulate_cmd import simulate_command
from xmlgen.validate_cmd import validate


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="kubevirt-gpu-passthrough")
def cli() -> None:
    """Debug GPU passthrough for KubeVirt: render, validate, discover, simulate a node."""


cli.add_command(render)
cli.add_command(validate)
cli.add_command(discover)
cli.add_command(doctor)
cli.add_command(simulate_command, name="simulate")


def main() -> None:
    run_cli(cli, "xmlgen")  # every failure an `error: …` line (schemas/clirun.py)
