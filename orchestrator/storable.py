"""What PostgreSQL can store, checked where values enter: JSON documents and free text.

PostgreSQL's ``text`` and ``jsonb`` cannot hold a NUL character (``\\u0000``) nor a lone UTF-16
surrogate (``\\ud800``, or the surrogate escapes Python uses for undecodable bytes), and a
``bigint`` holds only 64-bit integers. Python's ``json`` accepts NaN and turns ``1e400`` into an
infinity, neither of which is JSON that jsonb accepts. Every entry point (the command line, the
action proxy, ``RunStore.submit``, a step's outcome) checks its values here first, so a bad value
is refused with a message naming it instead of failing inside the database.
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any, NoReturn

from orchestrator.errors import InvalidInput
from orchestrator.jsontext import compact

MAX_JSON_DEPTH = 200
"""Arrays and objects nested deeper than this are refused (PostgreSQL's own parser, and
Python's, fail somewhere past a thousand levels, depending on the stack they run on)."""

BIGINT_MAX = 2**63 - 1


def check_text(value: str, what: str) -> str:
    """``value`` if PostgreSQL text can hold it: no NUL, valid Unicode (no lone surrogates)."""
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character (\\u0000), which cannot be stored")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(
            f"{what} is not valid UTF-8 text (it holds undecodable bytes or a lone surrogate)"
        ) from None
    return value


def storable_text(value: str) -> str:
    """``value`` with what PostgreSQL text cannot hold replaced by U+FFFD: for text that must be
    kept whatever it holds (what a model sent), where refusing it would lose the rest.

    Each NUL and each lone surrogate becomes one U+FFFD; a surrogate pair Python holds as two
    code points becomes the character it encodes.
    """
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return value


def storable_json(value: Any) -> Any:
    """``value`` (JSON) with every string, keys included, made ``storable_text``; ``value``
    itself when nothing needed it (the usual case, found by one compact encoding)."""
    try:
        if not needs_full_check(compact(value)):
            return value
    except (TypeError, ValueError):
        pass  # not JSON: walked as it is, and refused later by check_json with its place
    return _storable(value, 1)


def _storable(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if depth > MAX_JSON_DEPTH:
        return value  # check_json refuses it, naming it
    if isinstance(value, dict):
        return {
            storable_text(k) if isinstance(k, str) else k: _storable(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_storable(item, depth + 1) for item in value]
    return value


def check_bigint(value: object, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is an integer (not a bool) that PostgreSQL's bigint holds, >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"{what} must be an integer")
    if not minimum <= value <= BIGINT_MAX:
        raise InvalidInput(f"{what} must be between {minimum} and {BIGINT_MAX}")
    return value


def check_json(value: Any, what: str) -> Any:
    """``value`` if jsonb can hold it: JSON types only, finite numbers, storable strings, and
    at most ``MAX_JSON_DEPTH`` levels of nesting. Returns it unchanged.

    A refusal names where the bad value is (``result["refund"] is a coroutine, ...``).
    """
    # An explicit stack, not recursion: a deep value must be refused, not overflow the checker.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_json_string(value, item, what)
        elif isinstance(item, bool) or item is None or isinstance(item, int):
            continue
        elif isinstance(item, float):
            if not math.isfinite(item):
                _refuse(value, item, what, f"is {item!r}, which is not a JSON number")
        elif isinstance(item, dict | list | tuple):
            if depth > MAX_JSON_DEPTH:
                raise InvalidInput(
                    f"{what} is nested more than {MAX_JSON_DEPTH} levels deep; flatten it"
                )
            if isinstance(item, dict):
                for key, member in item.items():
                    if isinstance(key, str):
                        _check_json_string(value, key, what, container=item)
                    elif not isinstance(key, int | float) and key is not None:
                        # json writes int, float, bool and None keys as strings, nothing else
                        _refuse(
                            value, item, what, f"has an object key of type {type(key).__name__}"
                        )
                    stack.append((member, depth + 1))
            else:
                stack.extend((member, depth + 1) for member in item)
        else:
            hint = "; did you forget an await?" if inspect.isawaitable(item) else ""
            _refuse(
                value,
                item,
                what,
                f"is {_a(type(item).__name__)}, which JSON cannot represent{hint}",
            )
    return value


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _check_json_string(root: Any, text: str, what: str, container: Any = None) -> None:
    """``container``: the object whose key ``text`` is (the string itself is a value)."""
    where = text if container is None else container
    holds = "holds a string with" if container is None else "has a key with"
    if "\x00" in text:
        _refuse(root, where, what, f"{holds} a NUL character (\\u0000), which jsonb cannot store")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        _refuse(
            root,
            where,
            what,
            f"{holds} a lone surrogate (such as \\ud800), which is not valid Unicode",
        )


def _refuse(root: Any, item: Any, what: str, reason: str) -> NoReturn:
    raise InvalidInput(f"{what}{_path_to(root, item)} {reason}")


def _path_to(root: Any, target: Any) -> str:
    """Where ``target`` is inside ``root`` (found by identity), as ``["key"][0]``; ``""`` for
    ``root`` itself. Walked again only for a refusal, so the check itself stays cheap."""
    stack: list[tuple[Any, str, int]] = [(root, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if item is target:
            return path
        if depth > MAX_JSON_DEPTH:
            continue
        if isinstance(item, dict):
            stack.extend(
                (member, f"{path}[{_key(key)}]", depth + 1) for key, member in item.items()
            )
        elif isinstance(item, list | tuple):
            stack.extend(
                (member, f"{path}[{index}]", depth + 1) for index, member in enumerate(item)
            )
    return ""


def _key(key: Any) -> str:
    return json.dumps(key) if isinstance(key, str) else repr(key)


def needs_full_check(encoded: str) -> bool:
    """Whether compact, ASCII-only JSON text may hold a NUL or a lone surrogate.

    The encoder writes both as ``\\u`` escapes, so text without ``\\u0000`` or ``\\ud`` holds
    neither, and only the rare rest is walked value by value (an emoji's surrogate pair, or a
    literal backslash before ``u0000``, also trigger the walk, which then accepts them).
    """
    return "\\u0000" in encoded or "\\ud" in encoded


class InvalidJson(InvalidInput):
    """The text is not JSON at all (bad UTF-8, bad syntax, NaN, nesting past any limit)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_document(text: str | bytes, what: str) -> Any:
    """Parse JSON from outside (a file, standard input, a request body), strictly.

    Bytes must be UTF-8. Refused with ``InvalidJson``: invalid UTF-8, invalid JSON, NaN and
    infinities, integers of thousands of digits, nesting too deep to parse; with
    ``InvalidInput``: what ``check_json`` refuses (a float too large, deeper than
    ``MAX_JSON_DEPTH``, strings PostgreSQL cannot store).
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidJson(
                f"{what} is not valid UTF-8 (byte {error.start} cannot be decoded)"
            ) from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise InvalidJson(
            f"{what} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None
    except RecursionError:
        raise InvalidJson(
            f"{what} is nested more than {MAX_JSON_DEPTH} levels deep; flatten it"
        ) from None
    except ValueError as error:  # NaN/Infinity above, or an integer of thousands of digits
        raise InvalidJson(f"{what} is not valid JSON: {error}") from None
    return check_json(value, what)
