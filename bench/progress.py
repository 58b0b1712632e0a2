"""pytest plugin (``-p progress``, with bench/ on the path): one progress bar over the selected benchmarks, on stderr.

``prefixattn bench`` loads it; a plain ``pytest bench/`` does not (pytest's own output is unchanged there).
"""

from __future__ import annotations

import sys

_bar = None


def pytest_collection_finish(session):
    global _bar
    try:
        from tqdm import tqdm
    except ImportError:  # no tqdm: pytest's own progress output is all there is
        return
    _bar = tqdm(total=len(session.items), unit="bench", file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def pytest_runtest_logstart(nodeid, location):
    if _bar is not None:
        _bar.set_postfix_str(nodeid.split("::")[-1][:60], refresh=True)


def pytest_runtest_logfinish(nodeid, location):
    if _bar is not None:
        _bar.update(1)


def pytest_sessionfinish(session, exitstatus):
    if _bar is not None:
        _bar.close()
