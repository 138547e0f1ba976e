"""Builds every send-wait test case in one FLAGS_enable_pir_api=0 process; writes JSON.

Usage: ``FLAGS_enable_pir_api=0 python unittests/static_pass_utils/cases.py OUT.json``
(run by unittests/test_send_wait*.py). Each case records the op list before the pass, after
it, after a second application, and both reports.
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from unittests.static_pass_utils.programs import B, ENDPOINTS, F, Hand, build_real, op_list  # noqa: E402

from static_passes import optimize_pipeline_send_wait  # noqa: E402

E0, E1, E2 = ENDPOINTS[:3]


def record(program, startup=None, section=None):
    section = section or program
    before = op_list(section)
    first = optimize_pipeline_send_wait(program, startup)
    after = op_list(section)
    second = optimize_pipeline_send_wait(program, startup)
    return {"before": before, "after": after, "after_second": op_list(section),
            "report": first.to_dict(), "report_text": str(first), "second": second.to_dict()}


def stage0_1f1b(comm=True):
    """Stage 0 of 2: send h to stage 1 on ring 20, recv h@GRAD from it on ring 21."""
    p = Hand()
    if comm:
        p.ring(20, 0, [E0, E1])
        p.ring(21, 1, [E1, E0])
    p.compute("x", "h")
    p.send("h", ring=20, peer=1)
    p.sync(["h"], ring=20)
    p.recv("h@GRAD", ring=21, peer=0)
    p.compute("h@GRAD", "x@GRAD", role=B)
    return p


def hand_cases():
    cases = {}
    p = stage0_1f1b()
    cases["hand_1f1b"] = record(p.main, p.startup)
    p = stage0_1f1b(comm=False)
    cases["hand_1f1b_no_comm_setup"] = record(p.main)

    # F-then-B (a): the schedule says so (main program metadata, as fleet leaves it).
    p = stage0_1f1b()
    holder = Hand()
    holder.main._pipeline_opt = {"section_program": p.main, "schedule_mode": "F-then-B"}
    cases["hand_fthenb_schedule"] = record(holder.main, p.startup, section=p.main)
    # F-then-B (b): all forwards of two micro-batches, no backward recv after the sends.
    p = Hand()
    p.ring(20, 0, [E0, E1])
    for mb in (0, 1):
        p.compute(f"x{mb}", f"h{mb}")
        p.send(f"h{mb}", ring=20, peer=1)
        p.sync([f"h{mb}"], ring=20)
    cases["hand_fthenb_no_recv"] = record(p.main, p.startup)

    # Recv from another stage: stage 1 of 3 sends to stage 2, its backward recv comes from 0.
    p = Hand()
    p.ring(20, 1, [E0, E1])
    p.ring(21, 0, [E1, E2])
    p.ring(30, 1, [E0, E1])
    p.recv("a", ring=20, peer=0, role=F)
    p.compute("a", "h")
    p.send("h", ring=21, peer=1)
    p.sync(["h"], ring=21)
    p.recv("g", ring=30, peer=0)
    p.compute("g", "a@GRAD", role=B)
    cases["hand_recv_other_stage"] = record(p.main, p.startup)
    # Same ring, other peer: a 3-rank ring 40; send to its rank 2, recv from its rank 0.
    p = Hand()
    p.ring(40, 1, [E0, E1, E2])
    p.compute("x", "h")
    p.send("h", ring=40, peer=2)
    p.sync(["h"], ring=40)
    p.recv("g", ring=40, peer=0)
    cases["hand_same_ring_other_peer"] = record(p.main, p.startup)

    # The sent variable is written again (in place) before the recv.
    p = Hand()
    p.ring(20, 0, [E0, E1])
    p.ring(21, 1, [E1, E0])
    p.compute("x", "h")
    p.send("h", ring=20, peer=1)
    p.sync(["h"], ring=20)
    p.compute("h", "h")
    p.recv("h@GRAD", ring=21, peer=0)
    cases["hand_overwritten"] = record(p.main, p.startup)

    # Several sends per micro-batch: one sync each, and a shared sync.
    for shared in (False, True):
        p = Hand()
        p.ring(20, 0, [E0, E1])
        p.ring(21, 1, [E1, E0])
        p.compute("x", "h1")
        p.compute("x", "h2")
        p.send("h1", ring=20, peer=1)
        if not shared:
            p.sync(["h1"], ring=20)
        p.send("h2", ring=20, peer=1)
        p.sync(["h1", "h2"] if shared else ["h2"], ring=20)
        p.recv("h1@GRAD", ring=21, peer=0)
        p.recv("h2@GRAD", ring=21, peer=0)
        p.compute("h1@GRAD", "x@GRAD", role=B)
        cases["hand_two_sends_shared_sync" if shared else "hand_two_sends"] = record(p.main, p.startup)

    # The sync also guards a variable no forward send sent.
    p = Hand()
    p.ring(20, 0, [E0, E1])
    p.ring(21, 1, [E1, E0])
    p.compute("x", "h")
    p.compute("x", "other")
    p.send("h", ring=20, peer=1)
    p.sync(["h", "other"], ring=20)
    p.recv("h@GRAD", ring=21, peer=0)
    cases["hand_sync_guards_more"] = record(p.main, p.startup)

    # Two micro-batches unrolled 1F1B-style: only h_i@GRAD proves h_i's send finished.
    p = Hand()
    p.ring(20, 0, [E0, E1])
    p.ring(21, 1, [E1, E0])
    for mb in (0, 1):
        p.compute(f"x{mb}", f"h{mb}")
        p.send(f"h{mb}", ring=20, peer=1)
        p.sync([f"h{mb}"], ring=20)
    p.recv("h0@GRAD", ring=21, peer=0)
    p.compute("h0@GRAD", "x0@GRAD", role=B)
    p.compute("x2", "h2")
    p.recv("h1@GRAD", ring=21, peer=0)
    p.compute("h1@GRAD", "x1@GRAD", role=B)
    cases["hand_unrolled"] = record(p.main, p.startup)
    return cases


def real_cases():
    cases = {}
    for stages in (2, 3):
        for rank in range(stages):
            tag = f"real_{stages}stage_rank{rank}"
            main, section, startup = build_real(stages, rank, upstream_nop=True)
            cases[tag + "_upstream"] = record(main, startup, section)
            main, section, startup = build_real(stages, rank, upstream_nop=False)
            cases[tag + "_plain"] = record(main, startup, section)
    main, section, startup = build_real(2, 0, upstream_nop=False, comm_setup=False)
    cases["real_2stage_rank0_plain_no_comm_setup"] = record(main, startup, section)
    main, section, startup = build_real(2, 0, schedule="F-then-B")
    cases["real_2stage_rank0_fthenb"] = record(main, startup, section)
    return cases


if __name__ == "__main__":
    result = hand_cases()
    result.update(real_cases())
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
