"""Name -> object registries that refuse to overwrite and say what they know, and the keyword check that lets a
registered or user-supplied function be called whether or not it takes an optional keyword."""

from __future__ import annotations

import inspect
from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping plus :meth:`register`. Unknown names raise ``KeyError`` listing the known ones;
    registering a taken name raises ``ValueError`` (silent overwrites hide bugs in experiments)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered; choose another name")
        self._items[name] = item
        return item

    def decorator(self, name: str) -> Callable[[T], T]:
        def register(item: T) -> T:
            return self.register(name, item)

        return register

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(sorted(self._items))})"


def accepts_keyword(function: Callable, name: str) -> bool:
    """Whether ``function`` takes keyword ``name``: a parameter of that name, or ``**kwargs`` -- so that a rule
    written without an optional keyword still runs, and a wrapper (timing, logging) that passes ``**kwargs`` on does
    not silently lose what the function it wraps needs."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
