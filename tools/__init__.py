"""The demo trainer, the benchmarks and the GPU check of paddle_graphpp (run from a checkout).

Their process launcher, shared with the tests, is :mod:`testing.launch`.
"""
