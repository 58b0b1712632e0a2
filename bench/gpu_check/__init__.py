"""The GPU check: all GPU evidence in one call (``bash scripts/gpu_check.sh``; ``--dry-run`` on a CPU machine).

Run as ``python -m gpu_check`` with bench/ on ``PYTHONPATH`` (the script does that). Its modules:

- the program: :mod:`~gpu_check.driver` (command line, the steps in order, the result files) and
  :mod:`~gpu_check.clock` (the steps, their time budgets, the step clock);
- what it runs: :mod:`~gpu_check.cases` (the correctness case matrix, the timing shapes, attention FLOPs);
- how it measures: :mod:`~gpu_check.measure` (the timer, CUDA-graph capture, the GPU's clocks),
  :mod:`~gpu_check.floors` (the card's ceilings, a step of its own, and each shape's floors) and
  :mod:`~gpu_check.flashinfer_jit` (FlashInfer's modules built in the background, or ahead of time);
- the other steps: :mod:`~gpu_check.correctness`, :mod:`~gpu_check.graphs`, :mod:`~gpu_check.eager_small`,
  :mod:`~gpu_check.plan_ahead`, :mod:`~gpu_check.sanitizer`, :mod:`~gpu_check.timing`, :mod:`~gpu_check.model_step`
  (with :mod:`~gpu_check.model_layout`: the TokenBatcher's steps on a paged cache), :mod:`~gpu_check.hbm_bytes`,
  :mod:`~gpu_check.whole_batch` (with :mod:`~gpu_check.arrival_order`: an engine's default schedule);
- beside it: :mod:`~gpu_check.tile_sweep` (candidate tile configs on the timing shapes: the evidence behind
  ``prefixattn/autotune/configs/sm90.measured.json``).

The driver imports the other modules (and through them torch and Triton) only after it has chosen the Triton
interpreter or not (``--dry-run``), so this file imports nothing.
"""
