"""Builders of legacy static pipeline programs for the send-wait tests.

Import this only in a process started with ``FLAGS_enable_pir_api=0`` (the tests do that in a
subprocess). ``build_real`` uses Paddle's own static pipeline machinery (fleet
``strategy.pipeline`` -> ``PipelineOptimizer``), patched to build on a CPU wheel as
shared/DESIGN.md describes; the ``hand_*`` builders use ``block.append_op``.
"""

import os

assert os.environ.get("FLAGS_enable_pir_api") == "0", "set FLAGS_enable_pir_api=0 before importing paddle"

import paddle  # noqa: E402
from paddle.base import core, unique_name  # noqa: E402

paddle.enable_static()

F, B, OPT = 0, 1, 2
ENDPOINTS = [f"127.0.0.1:{6170 + i}" for i in range(4)]


# ----------------------------------------------------------------------------- inspection


def op_list(program):
    """[(type, inputs, outputs, ring_id)] of block 0: what the tests compare exactly."""
    out = []
    for op in program.global_block().ops:
        ring = op.attr("ring_id") if op.has_attr("ring_id") else None
        out.append([op.type, list(op.input_arg_names), list(op.output_arg_names), ring])
    return out


# ----------------------------------------------------------------------------- real programs


class _CudaLikeCore:
    """What pipeline.py sees as ``core``: "built with CUDA", whose CUDAPlace is the CPU place."""

    def __getattr__(self, name):
        return getattr(core, name)

    def is_compiled_with_cuda(self):
        return True

    def CUDAPlace(self, index):
        return core.CPUPlace()


def _cpu_init_communicator(self, program, current_endpoint, endpoints, rank, ring_id, wait_port,
                           global_ring_id=None, sync=True):
    # Upstream emits c_gen_nccl_id (not registered on CPU) + c_comm_init; keep the same ring,
    # rank and endpoints, written as the registered c_comm_init only.
    if current_endpoint is None:
        return
    block = program.global_block()
    comm_id = block.create_var(name=unique_name.generate("comm_id"), persistable=True,
                               type=core.VarDesc.VarType.RAW)
    block.append_op(type="c_comm_init", inputs={"X": comm_id}, outputs={},
                    attrs={"nranks": len(endpoints), "rank": rank, "ring_id": ring_id,
                           "endpoints": ",".join(endpoints), "op_role": F})


def build_real(num_stages, rank, schedule="1F1B", upstream_nop=True, comm_setup=True):
    """A real fleet static pipeline for ``rank``: (main, section program, startup program).

    upstream_nop=False disables upstream's own ``_optimize_forward_send_sync`` (a program
    Paddle did not optimise); comm_setup=False makes the communicator setup a no-op, as in the
    DESIGN.md probe, so that the pass has to fall back.
    """
    import paddle.distributed.fleet.meta_optimizers.common as common_mod
    import paddle.distributed.fleet.meta_optimizers.pipeline_optimizer as fleet_pipe
    import paddle.incubate.optimizer.pipeline as pipe_mod
    from paddle.distributed import fleet

    os.environ.update(
        PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(num_stages),
        PADDLE_TRAINER_ENDPOINTS=",".join(ENDPOINTS[:num_stages]),
        PADDLE_CURRENT_ENDPOINT=ENDPOINTS[rank],
    )
    saved = (pipe_mod.core, common_mod.CollectiveHelper._init_communicator,
             pipe_mod.PipelineOptimizer._optimize_forward_send_sync,
             fleet_pipe.PipelineOptimizer._init_process_group)
    pipe_mod.core = _CudaLikeCore()
    common_mod.CollectiveHelper._init_communicator = _cpu_init_communicator
    if not upstream_nop:
        pipe_mod.PipelineOptimizer._optimize_forward_send_sync = lambda self, program: None
    if not comm_setup:
        fleet_pipe.PipelineOptimizer._init_process_group = lambda self, pair, ring_map: None
    try:
        fleet.init(is_collective=True)
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup), unique_name.guard():
            with paddle.static.device_guard("gpu:0"):
                x = paddle.static.data("x", [4, 8], "float32")
                y = paddle.static.data("y", [4, 1], "float32")
                h = paddle.static.nn.fc(x, 8, activation="relu")
            for stage in range(1, num_stages):
                with paddle.static.device_guard(f"gpu:{stage}"):
                    h = paddle.static.nn.fc(h, 8 if stage < num_stages - 1 else 1)
            with paddle.static.device_guard(f"gpu:{num_stages - 1}"):
                loss = paddle.mean(paddle.square(h - y))
            strategy = fleet.DistributedStrategy()
            strategy.pipeline = True
            strategy.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2, "schedule_mode": schedule}
            fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy).minimize(loss)
    finally:
        (pipe_mod.core, common_mod.CollectiveHelper._init_communicator,
         pipe_mod.PipelineOptimizer._optimize_forward_send_sync,
         fleet_pipe.PipelineOptimizer._init_process_group) = saved
    return main, main._pipeline_opt["section_program"], startup


# ----------------------------------------------------------------------------- hand-made programs


class Hand:
    """A hand-made section program, built op by op with ``block.append_op``."""

    def __init__(self):
        self.main, self.startup = paddle.static.Program(), paddle.static.Program()
        self.block = self.main.global_block()

    def var(self, name):
        if not self.block.has_var(name):
            self.block.create_var(name=name, shape=[2, 4], dtype="float32")
        return self.block.var(name)

    def compute(self, x, out, role=F):
        self.block.append_op(type="scale", inputs={"X": self.var(x)}, outputs={"Out": self.var(out)},
                             attrs={"scale": 2.0, "op_role": role})

    def send(self, x, ring, peer, role=F, calc=False):
        self.block.append_op(type="c_sync_calc_stream", inputs={"X": self.var(x)}, outputs={"Out": self.var(x)},
                             attrs={"op_role": role})
        self.block.append_op(type="send_v2", inputs={"X": self.var(x)},
                             attrs={"ring_id": ring, "peer": peer, "use_calc_stream": calc, "op_role": role})

    def sync(self, names, ring, role=B):
        xs = [self.var(n) for n in names]
        self.block.append_op(type="c_sync_comm_stream", inputs={"X": xs}, outputs={"Out": xs},
                             attrs={"ring_id": ring, "op_role": role})

    def recv(self, out, ring, peer, role=B):
        self.block.append_op(type="recv_v2", outputs={"Out": self.var(out)},
                             attrs={"ring_id": ring, "peer": peer, "use_calc_stream": True, "op_role": role,
                                    "out_shape": [2, 4], "dtype": self.var(out).dtype})

    def ring(self, ring_id, rank, endpoints):
        """Communicator setup in the startup program, as fleet writes it."""
        block = self.startup.global_block()
        comm_id = block.create_var(name=f"comm_id_{ring_id}", persistable=True, type=core.VarDesc.VarType.RAW)
        block.append_op(type="c_comm_init", inputs={"X": comm_id}, outputs={},
                        attrs={"nranks": len(endpoints), "rank": rank, "ring_id": ring_id,
                               "endpoints": ",".join(endpoints), "op_role": F})
