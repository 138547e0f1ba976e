"""Support for the tests, apart from the lab tools in ``tools/``: importable from the repository
root (``unittests/conftest.py`` puts it first on ``sys.path``; the tools do the same), not installed.

* :mod:`testing.launch`: start processes in their own session under a time limit and leave none
  behind (the distributed tests' ranks; the trainer and the benchmarks start theirs with it too).
* :mod:`testing.parity`: graphed against eager on a small GPT stack, the engine's parity check on
  a GPU (the GPU tests run it; ``tools/gpu_check.py`` records its worst error).

The test files' own fixtures (fake graph runtimes, rank workers) stay beside them in ``unittests/``.
A test imports ``tools`` only for a tool it tests (the trainer, a benchmark, a diagnostic, the
reproduce and GPU-suite drivers) or for the trainer's GPT (``tools/gpt_torch.py``), which the GPU
tests run as their model because it is the model the benchmarks measure. ``paddle_graphpp`` imports
neither package (``unittests/test_import_cycles.py``).
"""
