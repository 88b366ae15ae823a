"""Which checkers are on (the stream sanitizer, the memory checker), readable without importing
them: hooks on hot paths (bccl collectives, graphs) check `active()`, which is a global read
while every checker is off."""

from __future__ import annotations

from typing import Any, Optional, Tuple

_tools: Tuple[Any, ...] = ()  # the enabled checkers, in the order they were enabled
_active: Optional[Any] = None  # what hooks report to: None, the one checker, or all of them


class _Each:
    """Hands every hook call to each enabled checker in turn."""

    def __init__(self, tools: Tuple[Any, ...]) -> None:
        self.tools = tools

    def __getattr__(self, hook: str):
        calls = [getattr(tool, hook) for tool in self.tools]

        def each(*args, **kwargs):
            for call in calls:
                call(*args, **kwargs)
        return each


def active() -> Optional[Any]:
    """The enabled checker (or one object reaching all of them), or None."""
    return _active


def add(tool: Any) -> None:
    global _tools
    if tool not in _tools:
        _tools = _tools + (tool,)
    _update()


def remove(tool: Any) -> None:
    global _tools
    _tools = tuple(t for t in _tools if t is not tool)
    _update()


def _update() -> None:
    global _active
    _active = None if not _tools else _tools[0] if len(_tools) == 1 else _Each(_tools)


def start(tool: Any, mode: Any) -> None:
    """Enters `tool`'s dispatch mode (it sees every operator from now on) and lets hooks reach it."""
    mode.__enter__()
    add(tool)


def stop(tool: Any, mode: Any) -> None:
    remove(tool)
    mode.__exit__(None, None, None)
