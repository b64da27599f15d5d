"""Pickling by reference: functe's ops and rules load from the module-level name they are bound to.

An op's rules are wrapped and its autograd Function classes are made per op, and a rule holds
conditions made by closures (``first_reason``), so neither pickles by value. Like a function,
each pickles as "the global ``name`` of ``module``" and loads today's definition.
"""

from __future__ import annotations

import importlib
import pickle
import sys
from typing import Any


def global_name(obj: Any, *homes: str | None) -> tuple[str, str] | None:
    """The (module, name) of a global bound to ``obj``: in the modules ``homes`` first, then in the
    other loaded modules of their packages (an op or rule may be re-exported or defined apart from
    its rules), then in any loaded module (an op a factory of one package made, bound in another's
    module); None when there is none. (Pickling only: the last scan reads every module's globals.)"""
    homes = tuple(dict.fromkeys(h for h in homes if h))
    packages = tuple({h.partition(".")[0] + "." for h in homes})
    loaded = sorted(m for m in list(sys.modules) if m not in homes)
    near = [m for m in loaded if m.startswith(packages)]
    far = [m for m in loaded if not m.startswith(packages)]
    for module_name in (*homes, *near, *far):
        module = sys.modules.get(module_name)
        for name, value in list(getattr(module, "__dict__", {}).items()) if module is not None else ():
            if value is obj:
                return module_name, name
    return None


def reachable_by_name(fn: Any) -> bool:
    """Whether pickle finds ``fn`` by its own module and qualified name (a function a decorator
    replaced with its wrapper is not: the name is bound to the wrapper)."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    value: Any = module
    for part in (getattr(fn, "__qualname__", None) or "<none>").split("."):
        value = getattr(value, part, None)
    return value is fn


def named(module_name: str, name: str, kind: type) -> Any:
    """The global ``module_name.name``, which must still be a ``kind`` (for unpickling)."""
    value = getattr(importlib.import_module(module_name), name, None)
    if not isinstance(value, kind):
        raise pickle.UnpicklingError(
            f"{module_name}.{name} was pickled as a {kind.__name__} and is now {type(value).__name__}"
        )
    return value
