"""Flat client methods kept for code written before the feature handles: each is one line
naming the handle and the handle's method it stands for, typed as that method."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

H = TypeVar("H")
P = ParamSpec("P")
T = TypeVar("T")


# Lower-case: it stands where a method is defined, as ``property`` does.
class delegate(Generic[H, P, T]):
    """``submit = delegate("runs", RunsHandle.submit)``: ``client.submit(...)`` calls
    ``client.runs.submit(...)``."""

    def __init__(self, handle: str, method: Callable[Concatenate[H, P], T]) -> None:
        self._handle = handle
        self._method = method
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, instance: object, owner: type[Any] | None = None) -> Callable[P, T]: ...

    def __get__(
        self, instance: object | None, owner: type[Any] | None = None
    ) -> Self | Callable[P, T]:
        if instance is None:
            return self
        method, handle = self._method, getattr(instance, self._handle)

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return method(handle, *args, **kwargs)

        call.__doc__ = self.__doc__
        return call
