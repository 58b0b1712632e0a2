"""``python -m peers.worker PROVIDER [PROVIDER ...]``: measure providers on shapes read as JSON lines from stdin.

Runs inside an engine's venv (the engine and prefixattn installed there), with ``bench/`` on ``PYTHONPATH`` and
``TRITON_INTERPRET=1``. Prints one JSON line per (provider, shape): ``{"provider", "shape", "metrics"}`` or
``{"provider", "shape", "error"}``; a failure of one never stops the others.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> int:
    from peers.measure import measure
    from batches.shapes import Shape, build_batch

    providers = argv
    for line in sys.stdin:
        if not line.strip():
            continue
        shape = Shape.from_json(line)
        batch = build_batch(shape)
        reference = None
        for provider in providers:
            record = dict(provider=provider, shape=line.strip())
            try:
                from prefixattn import reference_attention

                if reference is None:
                    reference = reference_attention(batch.q, batch.k_cache, batch.v_cache, batch.qo_indptr,
                                                    batch.kv_lens, batch.block_table)
                record["metrics"] = measure(provider, batch, reference)
            except Exception as exc:  # reported per provider; the parent turns it into a failed test
                record["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
