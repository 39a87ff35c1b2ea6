"""What an application calls never raises a driver exception: each becomes the project's
``DatabaseError`` (its cause kept), so callers catch one family of errors."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from orchestrator.db.connections import DRIVER_ERRORS, database_failed

P = ParamSpec("P")
T = TypeVar("T")


def project_errors(method: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Driver exceptions of ``method`` become ``DatabaseError``. ``TimeoutError`` passes as it
    is: ``wait`` raises it by contract."""

    @functools.wraps(method)
    async def translated(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except TimeoutError:
            raise
        except DRIVER_ERRORS as error:
            raise database_failed(error) from error

    return translated
