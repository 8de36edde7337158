"""Polling until a condition holds, shared by the test helpers (a module with a unique name: every test folder
has its own ``conftest``, so ``from conftest import ...`` would depend on which one was imported first)."""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, on_fail: Optional[Callable[[], str]] = None,
               *, interval: float = 0.25) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy, and return that value.

    ``predicate`` is called at least once, and once more when ``timeout`` seconds have passed.

    Raises:
        AssertionError: nothing truthy within ``timeout`` seconds; the message names ``what`` and the last value
            returned, followed by ``on_fail()`` (e.g. a log tail) when given.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this loop
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(interval, remaining))
    detail = f"\n{on_fail()}" if on_fail is not None else ""
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r}){detail}")
