"""`tools/check_resolve.py` reads the sets that CI resolves (`.ci/run` runs it against the index)
from pyproject.toml and the Dockerfile: these tests pin what it finds there, offline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from check_resolve import ROOT, all_extras, image_sets, project_sets


def test_every_extra_is_a_set() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^([\w-]+) = \[", block, re.M)
    assert [s.name for s in project_sets()] == [f"extra:{e}" for e in extras]
    assert all("torch==2.13.0" in s.requirements for s in project_sets())


def test_every_image_environment_is_a_set() -> None:
    sets = {s.name: s for s in image_sets()}
    assert set(sets) == {
        "image:cpu-build",
        "image:cuda-build",
        "image:cuda-build/opt/sglang",
        "image:npu-build",
    }
    # The asyncrl wheel stands for its dependencies and the extras in its brackets.
    assert "torch-npu==2.13.0" in sets["image:npu-build"].requirements
    assert any(r.startswith("ray[default]") for r in sets["image:cpu-build"].requirements)
    assert sets["image:cuda-build"].python == "3.12"  # Ubuntu 24.04's python3
    assert sets["image:cpu-build"].python == "3.11"


def test_sglang_has_an_environment_of_its_own() -> None:
    """SGLang pins torch and transformers to versions asyncrl's pins exclude: nothing installs it
    beside asyncrl, and its venv holds nothing else."""
    for s in [*project_sets(), *image_sets()]:
        has_sglang = any(re.match(r"sglang\b", r) for r in s.requirements)
        assert has_sglang == (s.name == "image:cuda-build/opt/sglang"), s
    (sglang,) = [s for s in image_sets() if s.name.endswith("/opt/sglang")]
    assert sglang.requirements == ("sglang==0.5.23",)


def test_an_unknown_extra_in_the_dockerfile_fails(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG PYTHON_IMAGE=python:3.11-slim\n"
        "FROM ${PYTHON_IMAGE} AS cpu-build\n"
        'RUN pip install --no-cache-dir "$(ls /wheels/asyncrl-*.whl)[rey]"\n'
    )
    with pytest.raises(SystemExit, match="rey"):
        image_sets(dockerfile)


def test_verifiers_and_the_agents_sdk_resolve_apart() -> None:
    """verifiers 0.4 needs openai<3 and the Agents SDK openai>=3: no extras union holds both,
    each is resolved with every other extra, and `dev` keeps verifiers out."""
    unions = {s.name: s.requirements for s in all_extras(project_sets())}
    assert set(unions) == {"extras:all", "extras:all+verifiers"}
    for name, requirements in unions.items():
        has = {
            p for p in ("verifiers", "openai-agents") if any(r.startswith(p) for r in requirements)
        }
        assert has == ({"verifiers"} if name.endswith("+verifiers") else {"openai-agents"}), name
    others = [s for s in project_sets() if s.name not in ("extra:agents", "extra:dev")]
    assert set(unions["extras:all+verifiers"]) == {r for s in others for r in s.requirements}
