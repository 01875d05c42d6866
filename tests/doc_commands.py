"""The commands a documentation page tells a user to run, read from its fenced `bash` blocks, so
that tests run what the pages say rather than a copy that can drift from them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_FILE = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```', re.M | re.S)


def commands(page: Path) -> list[list[str]]:
    """Every command of the page's bash blocks as argv, `&&` chains split; comments dropped."""
    found: list[list[str]] = []
    for block in _BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv:
                    found.append(argv)
    return found


def files(page: Path) -> dict[str, str]:
    """The files a page has the user write: its fenced blocks titled with a file name
    (```python title="my_agent.py"), name → text."""
    return dict(_FILE.findall(page.read_text()))


def asyncrl_args(page: Path, command: str) -> list[str]:
    """The arguments of the page's one `asyncrl COMMAND ...` (however the page spells the
    program: `asyncrl`, `.venv/bin/asyncrl`), without the program itself."""
    matches = [
        argv[1:]
        for argv in commands(page)
        if Path(argv[0]).name == "asyncrl" and argv[1:2] == [command]
    ]
    assert len(matches) == 1, f"{page.name}: {len(matches)} `asyncrl {command}` commands"
    return matches[0]
