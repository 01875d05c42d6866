"""The house rules of `asyncrl/`, read from the imports with `ast` (nothing is imported).

Every import counts: at the top, inside functions and under `if TYPE_CHECKING:`, since each is
a dependency a reader has to follow. The rules (docs/architecture.md, "Layout"):

- no import circle;
- a seam only declares: `engines/`, `weights/`, `environments/` and `agents/` keep their
  Protocol, its types and their own config; none imports a member of its family or anything of
  `sglang/`, and the choice of backend (the `match` on a config's `type`) lives in the builders
  (an agent's in the task builder alone);
- the ground floor (`configbase`, `items`, `plugins`, `reasons`) imports only itself;
- environments never import tasks; metrics never import what they measure;
- `agents/` and `gateway/` never import `tasks/` or `rollout/`; `rollout/` names `agents/` and
  `gateway/` only in its builder (and its config, which holds `rollout.gateway`);
- an episode function (`episodes/`, `agents/episode.py`) never imports the engine: it sees
  `Generation` and `SamplingParams`, the values a turn is made of, and awaits its turns;
- `sglang/` builds on `weights/`, never the reverse;
- no module over 700 lines, no class over 400: past that a reader no longer holds it whole; the
  episode scheduler keeps only groups, in 250.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "asyncrl"

SEAMS = {
    "asyncrl.engines": {"asyncrl.engines.base", "asyncrl.engines.config"},
    "asyncrl.weights": {
        "asyncrl.weights",
        "asyncrl.weights.base",
        "asyncrl.weights.config",
        "asyncrl.weights.fields",
    },
    "asyncrl.environments": {"asyncrl.environments", "asyncrl.environments.base"},
    "asyncrl.agents": {"asyncrl.agents", "asyncrl.agents.base", "asyncrl.agents.config"},
}
"""Each seam package and the modules that declare it (the rest of the package are members and
the parts members share)."""

SEAM_PARTS = {
    "asyncrl.engines.config",
    "asyncrl.weights.buckets",
    "asyncrl.weights.fields",
    "asyncrl.items",
    "asyncrl.reasons",
}
"""What a seam's declaration may import from asyncrl besides the ground floor: its config and
the value types its Protocol speaks in."""

GROUND = {"asyncrl.configbase", "asyncrl.items", "asyncrl.plugins", "asyncrl.reasons"}

BACKENDS = {
    "TorchEngine": "asyncrl.engines",
    "SglangEngine": "asyncrl.sglang",
    "BroadcastPublisher": "asyncrl.weights",
    "BroadcastSubscriber": "asyncrl.weights",
    "StorePublisher": "asyncrl.weights",
    "StoreSubscriber": "asyncrl.weights",
    "SglangPublisher": "asyncrl.sglang",
    "SglangSubscriber": "asyncrl.sglang",
    "TimedEnvironment": "asyncrl.environments",
    "RemotePool": "asyncrl.environments",
    "ToolEnvironment": "asyncrl.environments",
    "PythonAgent": "asyncrl.agents",
    "CommandAgent": "asyncrl.agents",
    "RemoteAgent": "asyncrl.agents",
    "VerifiersAgent": "asyncrl.agents",
}
"""Backend classes and the package they belong to."""

BUILDERS = {
    "asyncrl.rollout.backends": "the rollout role's engine and weight subscriber",
    "asyncrl.trainer.backends": "the trainer's weight publisher",
    "asyncrl.tasks.build": "the task and its environments or its agent, for both roles",
    # These always run the builtin engine in their own process; none chooses by `type`.
    "asyncrl.evaluate": "held-out evaluation on the trainer's weights",
    "asyncrl.serve.server": "`asyncrl serve`, the builtin engine behind SGLang's HTTP API",
    "asyncrl.tiny_model": "the quickstart model, warmed up on the builtin engine",
}
"""The modules outside a backend's package that may name its class, and why."""

SUBJECTS = (
    "asyncrl.tasks",
    "asyncrl.environments",
    "asyncrl.engines",
    "asyncrl.rollout",
    "asyncrl.trainer",
    "asyncrl.weights",
    "asyncrl.sglang",
    "asyncrl.serve",
    "asyncrl.queue",
)


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 400


def _module_of(dotted: str) -> str | None:
    """The module of `asyncrl` that `dotted` (a module, or a name in one) lies in."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imports(name: str) -> Iterator[tuple[str, str]]:
    """(module imported, name taken from it or '') for every import of asyncrl in `name`."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _module_of(alias.name)) is not None:
                    yield target, ""
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = _module_of(f"{base}.{alias.name}") if base else None
                if target is not None and target != base and target in MODULES:
                    yield target, ""
                elif (target := _module_of(base)) is not None:
                    yield target, alias.name


GRAPH: dict[str, set[str]] = defaultdict(set)
NAMES: dict[str, set[str]] = defaultdict(set)
for _mod in MODULES:
    for _target, _taken in _imports(_mod):
        if _target != _mod:
            GRAPH[_mod].add(_target)
            NAMES[_mod].add(_taken)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in MODULES:
        if start in index:
            continue
        work = [(start, iter(sorted(GRAPH[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(GRAPH[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_graph_is_read() -> None:
    # Guards the reader itself: known edges of each kind must be seen.
    assert "asyncrl.runstate" in GRAPH["asyncrl.heartbeat"]  # top level
    assert "asyncrl.engines.torch_engine" in GRAPH["asyncrl.rollout.backends"]  # in a function
    assert "TorchEngine" in NAMES["asyncrl.rollout.backends"]


def test_no_import_circle() -> None:
    assert _circles() == []


def test_the_circle_finder_finds_one() -> None:
    GRAPH["asyncrl.items"].add("asyncrl.tasks.base")
    try:
        assert any({"asyncrl.items", "asyncrl.tasks.base"} <= set(c) for c in _circles())
    finally:
        GRAPH["asyncrl.items"].discard("asyncrl.tasks.base")


def test_seams_only_declare() -> None:
    wrong = {
        (module, target)
        for package, declaring in SEAMS.items()
        for module in declaring
        for target in GRAPH[module]
        if not (target in declaring or target in SEAM_PARTS or target in GROUND)
        and (_within(target, package) or _within(target, "asyncrl.sglang"))
    }
    assert wrong == set(), "a seam imports a member of its family or SGLang's"


def test_seam_configs_do_not_import_sglang() -> None:
    configs = [m for m in MODULES if m.endswith(".config") and _within(m, "asyncrl.engines")]
    configs += ["asyncrl.weights.config", "asyncrl.environments.config"]
    wrong = {(m, t) for m in configs for t in GRAPH[m] if _within(t, "asyncrl.sglang")}
    assert wrong == set()


def test_only_builders_name_a_backend_class() -> None:
    wrong = {
        (module, cls)
        for module in MODULES
        for cls in NAMES[module] & set(BACKENDS)
        if module not in BUILDERS
        and not _within(module, BACKENDS[cls])
        # SGLang's members build on each other (its publisher asks its engine for URLs).
        and not (_within(module, "asyncrl.sglang") and BACKENDS[cls] == "asyncrl.sglang")
    }
    assert wrong == set()
    assert set(BUILDERS) <= set(MODULES), "a builder named here does not exist"


def test_only_the_task_builder_names_an_agent_class() -> None:
    agents = {cls for cls, package in BACKENDS.items() if package == "asyncrl.agents"}
    naming = {m for m in MODULES if NAMES[m] & agents and not _within(m, "asyncrl.agents")}
    assert naming == {"asyncrl.tasks.build"}


def test_the_ground_floor_imports_only_itself() -> None:
    wrong = {(m, t) for m in GROUND for t in GRAPH[m] if t not in GROUND}
    assert wrong == set()


def _imports_into(packages: tuple[str, ...], into: tuple[str, ...]) -> set[tuple[str, str]]:
    """(module, target) for each import by a module of `packages` of a module of `into`."""
    return {
        (m, t)
        for m in MODULES
        if any(_within(m, p) for p in packages)
        for t in GRAPH[m]
        if any(_within(t, s) for s in into)
    }


def test_environments_never_import_tasks() -> None:
    assert _imports_into(("asyncrl.environments",), ("asyncrl.tasks",)) == set()


def test_agents_and_the_gateway_never_import_tasks_or_the_rollout_role() -> None:
    packages = ("asyncrl.agents", "asyncrl.gateway")
    assert _imports_into(packages, ("asyncrl.tasks", "asyncrl.rollout")) == set()


ROLLOUT_WIRING = {"asyncrl.rollout.builder", "asyncrl.rollout.config"}
"""The rollout role's modules that may name agents and the gateway: the builder wires them in,
the config holds `rollout.gateway`."""


def test_the_rollout_role_names_agents_and_the_gateway_only_where_it_wires() -> None:
    wrong = _imports_into(("asyncrl.rollout",), ("asyncrl.agents", "asyncrl.gateway"))
    assert {m for m, _ in wrong} <= ROLLOUT_WIRING, wrong
    assert set(MODULES) >= ROLLOUT_WIRING


EPISODES = ("asyncrl.episodes", "asyncrl.agents.episode")
TURN_VALUES = {"asyncrl.engines.base": {"Generation"}, "asyncrl.engines.config": {"SamplingParams"}}
"""What of the engine seam an episode may take: the values a turn is made of."""


def _taken(module: str, target: str) -> set[str]:
    """The names `module` imports from `target` ('' for the module itself)."""
    return {name for t, name in _imports(module) if t == target}


def test_episode_functions_never_import_the_engine() -> None:
    episodes = [m for m in MODULES if any(_within(m, e) for e in EPISODES)]
    assert len(episodes) >= 4, episodes  # the reader sees them
    wrong = {
        (m, t, name)
        for m in episodes
        for t in GRAPH[m]
        if _within(t, "asyncrl.engines")
        or _within(t, "asyncrl.sglang")
        or _within(t, "asyncrl.rollout")
        for name in _taken(m, t) - TURN_VALUES.get(t, set())
    }
    assert wrong == set(), "an episode imports the engine or the side that runs it"


def test_metrics_never_import_their_subjects() -> None:
    assert _imports_into(("asyncrl.metrics",), SUBJECTS) == set()


def test_weights_never_import_sglang() -> None:
    assert _imports_into(("asyncrl.weights",), ("asyncrl.sglang",)) == set()


def _too_long(max_module: int, max_class: int) -> list[str]:
    """Each module of more than `max_module` lines and each class of more than `max_class`
    (from its first decorator to its last line), with its count."""
    found = []
    for name, tree in TREES.items():
        if (lines := len(MODULES[name].read_text().splitlines())) > max_module:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                assert node.end_lineno is not None
                if (lines := node.end_lineno - first + 1) > max_class:
                    found.append(f"{name}.{node.name}: {lines} lines")
    return found


def test_no_module_or_class_is_too_long() -> None:
    assert _too_long(MAX_MODULE_LINES, MAX_CLASS_LINES) == []


def test_the_episode_scheduler_keeps_only_groups() -> None:
    # What an episode does lives in its own function (`episodes/`, `agents/episode.py`); the
    # scheduler that once held all three kinds in 395 lines keeps groups, in 250 at most.
    found = [f for f in _too_long(250, 250) if f.startswith("asyncrl.rollout.scheduler")]
    assert found == []


def test_the_size_reader_counts_modules_and_classes() -> None:
    # Guards the reader: with the limits lowered, known modules and classes must be named.
    found = _too_long(200, 100)
    assert "asyncrl.rollout.scheduler" in {f.partition(":")[0] for f in found}
    assert "asyncrl.rollout.scheduler.EpisodeScheduler" in {f.partition(":")[0] for f in found}
