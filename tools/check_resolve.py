"""Checks that every extra of pyproject.toml and every Python environment the Dockerfile builds
has a solution on the package index. Installs nothing: `uv pip compile`, metadata only where the
index serves it (PEP 658). uv's resolver answers pip's question (is there a set of versions that
satisfies every requirement?) from the same metadata in seconds, where pip's `install --dry-run`
took about five minutes on CI's two cores (CPU-bound, not waiting on the index).

  python tools/check_resolve.py            # every set, a few at a time; exit 1 if one fails
  python tools/check_resolve.py --list     # the sets and their requirements (no network)
  python tools/check_resolve.py extra:ray image:cuda-build

Sets:
- `extra:NAME`: asyncrl's dependencies plus the extra's, for this interpreter and machine (CI's
  Python 3.11 on Linux), sdists allowed — what `pip install 'asyncrl[NAME]'` resolves. They are
  resolved together first, as `extras:all` (a solution of all is one of each); one by one only
  when that fails, to name the culprit. Extras that conflict by design (`APART`) are left out
  of `extras:all` and resolved as `extras:all+NAME`: with every extra they do not exclude.
- `image:STAGE`: each `pip install` of a Dockerfile build stage (`STAGE/VENV` where a stage
  makes a second environment) with the ARG defaults filled in, resolved for the stage's Python
  (`IMAGE_PYTHON`, by base image) on manylinux x86_64, wheels only. The asyncrl wheel stands for
  its dependencies and the extras in brackets. `--index-url` is dropped: the check asks the
  default index, where the CPU index's `torch==V` (its `V+cpu`) has the same dependencies.

uv runs with `--no-config` (no uv.toml, and it never reads pip.conf), so a local wheel folder or
constraint file cannot make a set look resolvable.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The Python each Dockerfile base image (its ARG name) brings: the official image's, Ubuntu
# 24.04's python3, the CANN image's (its tag says py3.11).
IMAGE_PYTHON = {"PYTHON_IMAGE": "3.11", "CUDA_IMAGE": "3.12", "CANN_IMAGE": "3.11"}
# The images' platform: Ubuntu 24.04's glibc 2.39 (uv counts every older manylinux with it).
PLATFORM = "x86_64-manylinux_2_39"
# Versions reported after a set resolves: the pins that decide whether sets can share a venv.
SHOWN = ("torch", "transformers", "sglang", "ray", "torch-npu")


@dataclass(frozen=True)
class RequirementSet:
    name: str
    requirements: tuple[str, ...]
    python: str | None = None
    """Target Python (`X.Y`, on manylinux, wheels only); None: this interpreter and machine."""


def project_sets(pyproject: Path = ROOT / "pyproject.toml") -> list[RequirementSet]:
    project = tomllib.loads(pyproject.read_text())["project"]
    base = tuple(project["dependencies"])
    return [
        RequirementSet(f"extra:{name}", (*base, *extra))
        for name, extra in project.get("optional-dependencies", {}).items()
    ]


APART = {"verifiers": ("agents", "dev")}
"""Extras that never share a venv with the extras named: verifiers 0.4 needs `openai<3`, the
OpenAI Agents SDK (`agents`, and `dev`, which has it) `openai>=3`. Users keep verifiers in a venv
of its own (`task.python`), as an agent on the other `openai` runs as a command."""


def all_extras(sets: list[RequirementSet]) -> list[RequirementSet]:
    """Every extra at once: what solves it solves each extra alone (fewer requirements), so one
    resolution stands for all of them; only when it fails are they resolved one by one. An extra
    of `APART` is left out of it and resolved in a union of its own, without those it excludes."""

    def union(name: str, names: set[str]) -> RequirementSet:
        chosen = [s for s in sets if s.name.removeprefix("extra:") in names]
        return RequirementSet(name, tuple(dict.fromkeys(r for s in chosen for r in s.requirements)))

    every = {s.name.removeprefix("extra:") for s in sets}
    return [
        union("extras:all", every - set(APART)),
        *(
            union(f"extras:all+{x}", every - set(APART) - set(out) | {x})
            for x, out in APART.items()
        ),
    ]


def _with_extras(extras: str, pyproject: Path) -> tuple[str, ...]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    wanted = [e.strip() for e in extras.split(",") if e.strip()]
    if unknown := [e for e in wanted if e not in optional]:
        raise SystemExit(f"Dockerfile asks for unknown extra(s) of asyncrl: {unknown}")
    return (*project["dependencies"], *(r for e in wanted for r in optional[e]))


def image_sets(
    dockerfile: Path = ROOT / "Dockerfile", pyproject: Path = ROOT / "pyproject.toml"
) -> list[RequirementSet]:
    """One set per (build stage, venv) that runs `pip install`."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())  # join continued lines
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    base_of: dict[str, str] = {}  # stage → the ARG naming its base image
    sets: list[RequirementSet] = []
    for stage in re.split(r"^(?=FROM )", text, flags=re.M)[1:]:
        head = stage.split()
        source, name = head[1], head[3] if len(head) > 3 else head[1]
        base_of[name] = base_of.get(source, source.strip("${}"))
        by_venv: dict[str, list[str]] = {}
        for command in re.findall(r"^RUN (.+)$", stage, re.M):
            for part in re.split(r"&&|;", command):
                words = shlex.split(part)
                pip = [i for i, w in enumerate(words) if w.endswith("pip") or w == "pip"]
                if not pip or words[pip[0] + 1 : pip[0] + 2] != ["install"]:
                    continue
                venv = words[pip[0]].rsplit("/bin/", 1)[0] if "/bin/" in words[pip[0]] else ""
                by_venv.setdefault(venv, []).extend(_pip_requirements(words[pip[0] + 2 :], args))
        for venv, words in by_venv.items():
            requirements: list[str] = []
            for word in words:
                if wheel := re.fullmatch(r".*asyncrl-\*\.whl\)?(?:\[([\w,]*)\])?", word):
                    requirements += _with_extras(wheel.group(1) or "", pyproject)
                else:
                    requirements.append(word)
            python = IMAGE_PYTHON.get(base_of[name])
            if python is None:
                raise SystemExit(f"{name}: base image {base_of[name]} not in IMAGE_PYTHON")
            label = f"image:{name}" + (f"{venv}" if venv and venv != "/opt/venv" else "")
            sets.append(RequirementSet(label, tuple(requirements), python))
    return sets


def _pip_requirements(words: list[str], args: dict[str, str]) -> list[str]:
    """The requirement words of a `pip install` command line, its options dropped."""
    with_value = {"--index-url", "-i", "--extra-index-url", "--find-links", "-f", "-c", "-r"}
    out: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in with_value:
            skip = True
        elif not word.startswith("-"):
            out.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], word))
    return out


def resolve(req: RequirementSet) -> tuple[bool, str]:
    """(resolved, what to print): the versions chosen, or the resolver's complaint."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "uv", "pip", "compile", "-", "--no-config", "--no-header"]
    cmd += ["--no-annotate", "--no-python-downloads", "--quiet"]
    if req.python is not None:
        cmd += ["--python-version", req.python, "--python-platform", PLATFORM]
        cmd += ["--only-binary", ":all:"]
    result = subprocess.run(
        cmd,
        input="\n".join(req.requirements),
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("warning")]
        return False, "\n    ".join(lines[-12:])
    pins = (ln.split("==", 1) for ln in result.stdout.splitlines() if "==" in ln)
    chosen = {re.sub(r"[-_.]+", "-", name).lower(): version.strip() for name, version in pins}
    versions = " ".join(f"{n}=={chosen[n]}" for n in SHOWN if n in chosen)
    return True, f"{versions} ({time.monotonic() - start:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only these sets (default: all)")
    parser.add_argument("--list", action="store_true", help="print the sets, resolve nothing")
    parser.add_argument("--jobs", type=int, default=4, help="resolutions at once")
    args = parser.parse_args(argv)
    extras = project_sets()
    sets = [*all_extras(extras), *image_sets()]
    if args.names:
        known = {s.name: s for s in [*extras, *sets]}
        if unknown := set(args.names) - set(known):
            parser.error(f"unknown set(s) {sorted(unknown)}; --list shows them")
        sets = [known[name] for name in args.names]
    if args.list:
        for s in [*extras, *sets]:
            print(f"{s.name} (python {s.python or 'here'}): {' '.join(s.requirements)}")
        return 0
    start = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(sets, pool.map(resolve, sets), strict=True))
        if any(s.name.startswith("extras:all") and not results[s][0] for s in sets):
            # Which extra fails (or whether they only conflict with each other).
            results.update(zip(extras, pool.map(resolve, extras), strict=True))
    for s, (ok, detail) in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {s.name}: {detail}", flush=True)
    failed = [s.name for s, (ok, _) in results.items() if not ok]
    took = time.monotonic() - start
    print(f"{'FAILED: ' + ' '.join(failed) if failed else 'every set resolves'} ({took:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
