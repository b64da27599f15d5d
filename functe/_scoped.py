"""Process-wide settings with scoped overrides (``with`` blocks) that may close in any order.

A setting (the kernel backend, the collectives' cross-rank check) is a module global that hot paths
read directly (torch.compile guards a global's value; it cannot trace a ContextVar). A ``with`` block
that saved the value and restored it on exit went wrong with threads: blocks opened in two threads
and closed in the opposite order left the setting switched after both had closed. Here each open
block is an entry of a dict (insertion-ordered; adding and removing a key are atomic under the GIL,
and a dict, unlike a lock, is something Dynamo traces under ``fullgraph=True``), and the value in
force is the newest open block's, else the default. The setting stays process-wide: while any
thread has a block open, every thread sees it (documented in docs/design.md).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any


class ScopedSetting:
    """A default plus open overrides; ``publish(value)`` stores the value in force where it is read."""

    def __init__(self, default: Any, publish: Callable[[Any], None]):
        self._default, self._open, self._publish = default, {}, publish
        self._tokens = itertools.count()  # (next() on it is atomic under the GIL)
        publish(default)

    def set_default(self, value: Any) -> None:
        """The value in force when no block is open."""
        self._default = value
        self._refresh()

    @contextlib.contextmanager
    def scoped(self, value: Any) -> Iterator[None]:
        token = next(self._tokens)  # (this block's key)
        self._open[token] = value
        self._refresh()
        try:
            yield
        finally:
            del self._open[token]
            self._refresh()

    def _refresh(self) -> None:
        self._publish(next(reversed(self._open.values())) if self._open else self._default)
