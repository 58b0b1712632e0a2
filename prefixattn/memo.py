"""One memo for the per-step argument checks and lookups plan() repeats (an engine passes the same values every step).

:func:`typed_memo` is ``functools.lru_cache(typed=True)``: the key holds every argument's value *and type*, so an
argument equal to a valid one of another type (``16.0 == 16``, ``True == 1``) is still checked and refused; a call
that raises is never remembered; and an unhashable argument (a list where an int belongs) skips the memo, so the
function's own check names it instead of ``lru_cache``'s ``TypeError``.
"""

from __future__ import annotations

import functools


def typed_memo(maxsize: int):
    """Decorator: remember up to ``maxsize`` results of a pure function by its arguments' values and types."""

    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize, typed=True)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return cached(*args, **kwargs)
            except TypeError:  # an unhashable argument (or fn's own TypeError, raised again below)
                return fn(*args, **kwargs)

        call.cache_clear = cached.cache_clear
        return call

    return decorate
