"""Paddle collectives inside graphs: the custom all-reduce (:mod:`.allreduce`)."""
