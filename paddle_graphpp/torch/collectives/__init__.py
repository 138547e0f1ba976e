"""PyTorch collectives inside graphs: the custom all-reduce (:mod:`.allreduce`, its push kernel
:mod:`.push_allreduce`), tensor-parallel layers that use it (:mod:`.tensor_parallel`), and capture
agreement across ranks (:mod:`.agreement`)."""
