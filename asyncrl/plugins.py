"""User code by import path: rewards, task factories, environment classes and tools from
outside the package, loaded one way (their config sections derive from
`asyncrl.configbase.PluginConfig`).

`load_object("mypkg.rewards:score", python_path)` imports `mypkg.rewards` with the given
directories and the working directory on `sys.path`, and returns its `score`. Configs call it
when they are validated, so a path that does not import or a function that cannot take the
call fails the config with one line naming the key, before any process starts. How each kind
runs is its owner's: a reward in a process of its own (`asyncrl.tasks.isolated`), an
environment under a per-call timeout (`asyncrl.environments.local`), tools on threads
(`asyncrl.environments.tools`). Nothing here imports beyond the standard library, so that a
reward's process starts without pydantic.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any


def absolute_dirs(dirs: Sequence[str]) -> list[str]:
    """`python_path` entries made absolute against the working directory, so that the resolved
    config means the same in every role it is handed to."""
    return [os.path.abspath(d) for d in dirs]


def load_object(path: str, python_path: Sequence[str] = ()) -> Callable[..., Any]:
    """The callable named by `path` ("package.module:name", name may be dotted); ValueError
    with a one-line reason when the path is malformed, does not import, or names no callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r}: expected 'package.module:function'")
    for entry in reversed(python_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    # `python -m asyncrl` has the working directory on the path; the `asyncrl` script does not.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is a config error
        raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    _check_not_shadowed(module_name, python_path)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a function")
    return obj


def _check_not_shadowed(module_name: str, python_path: Sequence[str]) -> None:
    """ValueError when `python_path` holds the module but another one of its name, with other
    code, was imported first (e.g. two configs' `agent:solve` from different folders): Python
    reuses a module by name, so the code named here would silently never run."""
    top = module_name.split(".")[0]
    loaded = getattr(sys.modules.get(top), "__file__", None)
    for entry in python_path:
        here = [os.path.join(entry, top + ".py"), os.path.join(entry, top, "__init__.py")]
        found = next((f for f in here if os.path.isfile(f)), None)
        if found is None:
            continue
        if loaded is not None and not _same_file(loaded, found):
            raise ValueError(
                f"module {top!r} is already imported from {loaded}, so {found} would never run: "
                "give one of them another name"
            )
        return


def _same_file(a: str, b: str) -> bool:
    """One file, or two with the same code (a copy: reusing it runs what both say)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def check_signature(fn: Callable[..., Any], call: str, *args: Any, **kwargs: Any) -> None:
    """ValueError unless `fn(*args, **kwargs)` binds; `call` shows the expected call."""
    try:
        signature = inspect.signature(fn)
    except ValueError:  # some builtins have none: the first call will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"cannot be called as {call}: {exc}") from None


def factory_kwargs(
    factory: Callable[..., Any], kwargs: dict[str, Any], tokenizer: Any
) -> dict[str, Any]:
    """The keyword arguments a task factory is called with: `kwargs`, and the tokenizer when
    it has a `tokenizer` parameter."""
    try:
        wants = "tokenizer" in inspect.signature(factory).parameters
    except ValueError:
        wants = False
    return {**kwargs, "tokenizer": tokenizer} if wants else dict(kwargs)


def call_shape(name: str, args: Sequence[str], kwargs: dict[str, Any]) -> str:
    """How a plugin is called, for errors: `fn(response, answer, bonus=...)`."""
    return f"{name}({', '.join([*args, *(f'{k}=...' for k in kwargs)])})"
