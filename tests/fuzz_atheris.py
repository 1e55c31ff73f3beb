"""Coverage-guided fuzzing (atheris, i.e. libFuzzer) of the parsers and the builder: ``make fuzz``.

    python -m tests.fuzz_atheris [libFuzzer flags, e.g. -runs=100000 -max_total_time=60]

The first byte of each input picks a target, the rest is its input:

0. ``PciAddress.parse`` / ``parse_list`` (text)      4. ``build_domain``: the input as domain XML, seed VMI
1. ``parse_pool`` (a variable picked by one byte)      5. ``build_domain``: the input as domain XML, no VMI
2. ``parse_environ`` (bytes)                           6. ``build_domain``: seed domain, the input as VMI JSON
3. ``parse_vmi`` (bytes)

Each target either returns, and its result is checked (addresses round-trip, a built domain parses whole
with exactly the allocated GPUs), or raises ``InputError``. Any other exception or a failed check is a crash:
libFuzzer stops, prints the traceback and writes the input to ``crash-<sha1>`` (``-artifact_prefix=DIR/``).
Seeds (the bundled example's domain, VMI and env, once per target) are passed with ``-seed_inputs``, so no
corpus directory is written unless one is given.

``tests/test_fuzz.py`` is the hypothesis side; ``tests/test_fuzz_atheris.py`` runs this briefly in pytest.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import atheris
from atheris.import_hook import instrument_imports

with instrument_imports(include=["launcher_hook", "schemas"]):
    from launcher_hook import build_domain
    from launcher_hook.allocation import parse_environ, parse_pool
    from launcher_hook.domain import hostdev_source_key, parse_domain
    from schemas import InputError, PciAddress
    from schemas.vmi import parse_vmi

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "seed-node01"
SEED_DOMAIN = (EXAMPLE / "domain.xml").read_bytes()
SEED_VMI = (EXAMPLE / "vmi.json").read_bytes()
SEED_ENVIRON = (EXAMPLE / "compute.environ").read_bytes()
RTX_VAR = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
ENV = {RTX_VAR: "0000:86:00.0,0000:af:00.0", "PATH": "/bin"}
EXPECTED = {"ua-gpu0": ("pci", "0000:86:00.0"), "ua-gpu1": ("pci", "0000:af:00.0")}
POOL_VARIABLES = (RTX_VAR, "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q", "PCI_RESOURCE_X")
TARGETS = 7
SEEDS = {
    "pci": b"\x00" + b"0000:86:00.0,10000:e1:1f.7",
    "pool": b"\x01\x00" + ENV[RTX_VAR].encode() + b",",
    "mdev-pool": b"\x01\x01" + b"7b7b1e7a-2a34-4a61-9c1e-0b8f1a1b2c3d,E3F0A6B2-58C4-4F6B-8E9D-2B1C0D9E8F7A",
    "environ": b"\x02" + SEED_ENVIRON,
    "environ-nul": b"\x02" + SEED_ENVIRON.replace(b"\n", b"\0"),
    "vmi": b"\x03" + SEED_VMI,
    "domain": b"\x04" + SEED_DOMAIN,
    "domain-no-vmi": b"\x05" + SEED_DOMAIN,
    "vmi-in-builder": b"\x06" + SEED_VMI,
}


def _pci(text: str) -> None:
    try:
        address = PciAddress.parse(text)
    except InputError:
        pass
    else:
        if PciAddress.parse(str(address)) != address:
            raise AssertionError(f"{text!r} parsed as {address!r}, which does not read back")
    listed = PciAddress.parse_list(text)
    if listed is not None and listed != [PciAddress.parse(item) for item in text.split(",")]:
        raise AssertionError(f"the fast list parser disagrees with item-by-item parsing on {text!r}")


def _pool(selector: int, value: str) -> None:
    variable = POOL_VARIABLES[selector % len(POOL_VARIABLES)]
    try:
        pool = parse_pool(variable, value)
    except InputError:
        return
    if len(set(pool.ids)) != len(pool.ids):
        raise AssertionError(f"{value!r}: a device listed twice was accepted")


def _check_built(output: bytes) -> None:
    """A whole domain holding exactly the two allocated GPUs, once each."""
    parsed = parse_domain(output, 1 << 26)
    ours = {}
    for hostdev in parsed.root.iterfind("devices/hostdev"):
        key = hostdev_source_key(hostdev)
        if key in EXPECTED.values():
            alias = hostdev.find("alias")
            name = alias.get("name") if alias is not None else None
            if name in ours:
                raise AssertionError(f"{name} written twice")
            ours[name] = key
    if ours != EXPECTED:
        raise AssertionError(f"the built domain holds {ours}, expected {EXPECTED}")


def _build(domain: bytes, vmi: bytes | None) -> None:
    try:
        result = build_domain(domain, vmi, ENV)
    except InputError:
        return
    _check_built(result.domain_xml)


def one_input(data: bytes) -> None:
    if not data:
        return
    target, payload = data[0] % TARGETS, data[1:]
    if target == 0:
        _pci(payload.decode("utf-8", "replace"))
    elif target == 1:
        _pool(payload[0] if payload else 0, payload[1:].decode("utf-8", "replace"))
    elif target == 2:
        with contextlib.suppress(InputError):
            parse_environ(payload)
    elif target == 3:
        with contextlib.suppress(InputError):
            parse_vmi(payload)
    elif target == 4:
        _build(payload, SEED_VMI)
    elif target == 5:
        _build(payload, None)
    else:
        try:
            result = build_domain(SEED_DOMAIN, payload, ENV)
        except InputError:
            return
        parse_domain(result.domain_xml, 1 << 26)


def write_seeds(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in SEEDS.items():
        path = directory / name
        path.write_bytes(data)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv if argv is None else argv)
    if not any(arg.startswith("-seed_inputs=") for arg in args):
        seeds = write_seeds(Path(tempfile.gettempdir()) / "kubevirt-gpu-passthrough-fuzz-seeds")
        args.append("-seed_inputs=" + ",".join(str(path) for path in seeds))
    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
