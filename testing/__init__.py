"""Support for the tests, apart from the lab tools in ``tools/``: importable from the repository
root (``unittests/conftest.py`` puts it first on ``sys.path``; the tools do the same), not installed.

* :mod:`testing.launch`: start processes in their own session under a time limit and leave none
  behind (the distributed tests' ranks; the trainer and the benchmarks start theirs with it too).
* :mod:`testing.parity`: graphed against eager on a small GPT stack, the engine's parity check on
  a GPU (the GPU tests run it; ``tools/gpu_check.py`` records its worst error).
* :mod:`testing.gpt_torch`, :mod:`testing.gpt_shape`: the trainer's GPT (PyTorch) and its shape;
  the GPU tests run it as their model because it is the model the benchmarks measure.

The test files' own fixtures (fake graph runtimes, rank workers) stay beside them in ``unittests/``.
A test imports ``tools`` only for a tool it tests (the trainer, a benchmark, a diagnostic, the
reproduce and GPU-suite drivers). The tools may import ``testing``; ``testing`` imports no
``tools`` module, and ``paddle_graphpp`` imports neither package
(``unittests/test_structure_lab.py``, ``unittests/test_import_cycles.py``).
"""
