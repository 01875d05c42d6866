"""The documentation site: it builds with warnings as errors (links and anchors checked), its
generated reference pages match the code, and the config reference lists every key. The
getting-started page's quickstart command is what `role_procs.launch_all` runs (test_e2e)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from asyncrl.config import Config, load_config

import gen_reference
from doc_commands import asyncrl_args, commands, files

REPO = Path(__file__).resolve().parent.parent


def test_reference_pages_match_the_code() -> None:
    proc = subprocess.run(
        [sys.executable, "tools/gen_reference.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def _models(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    found = [(path, model)]
    for name, field in model.model_fields.items():
        for member in gen_reference._members(field.annotation):
            found += _models(member, f"{path}.{name}" if path else name)
    return found


def test_config_reference_lists_every_key() -> None:
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    sections = page.split("\n## ")
    for path, model in _models(Config):
        tag = gen_reference._tag(model)
        title = f"`{path}` (type: `{tag}`)" if tag and path else (f"`{path}`" if path else "top")
        section = next((s for s in sections if s.startswith(title)), None)
        assert section is not None, f"no section {title}"
        for name in model.model_fields:
            assert f"\n| `{name}` |" in section, f"{title}: key {name} missing"


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra (`pip install -e '.[docs]'`)")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The home page pulls the front page's introduction in (one text, two places).
    assert "version-stamped trajectories" in (tmp_path / "index.html").read_text()


def test_tutorial_configs_parse() -> None:
    """Every `--config FILE` a page names exists and parses (the runs themselves are the e2e
    tests': a tutorial's command that needs a GPU or a cluster cannot run here), but for the
    files the page itself has the user write and those a run writes (`runs/`), which the test
    that runs the page reads (test_first_agent)."""
    named = set()
    for page in (REPO / "docs").rglob("*.md"):
        written = files(page)
        for argv in commands(page):
            if "--config" in argv and argv.index("--config") + 1 < len(argv):
                name = argv[argv.index("--config") + 1]
                if name not in written and not name.startswith("runs/"):
                    named.add(name)
    configs = {n for n in named if n.endswith((".yaml", ".yml")) and not n.startswith("/")}
    assert "configs/quickstart.yaml" in configs
    for name in sorted(configs):
        assert (REPO / name).is_file(), name
        load_config(REPO / name)


def test_getting_started_runs_the_quickstart() -> None:
    assert asyncrl_args(REPO / "docs" / "getting-started.md", "launch")[:5] == [
        "launch",
        "--role",
        "all",
        "--config",
        "configs/quickstart.yaml",
    ]
