"""The send-wait pass on real and hand-made legacy static pipeline programs (Paddle 3.3.1 CPU).

All programs are built in one ``FLAGS_enable_pir_api=0`` subprocess
(unittests/static_pass_utils/cases.py); these tests assert the exact op sequences it recorded.
"""

import pytest

from static_pass_utils.runner import run_script

pytest.importorskip("paddle")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return run_script("cases.py", tmp_path_factory.mktemp("send_wait") / "cases.json")


def seq(case, key="after"):
    """Op sequence as (type, inputs, outputs, ring) tuples."""
    return [(t, tuple(i), tuple(o), r) for t, i, o, r in case[key]]


def unchanged(case):
    assert case["after"] == case["before"]
    assert not case["report"]["changed"]
    assert case["report"]["removed_syncs"] == [] and case["report"]["inserted_nops"] == []


def idempotent(case):
    assert case["after_second"] == case["after"]
    assert not case["second"]["changed"]


# ----------------------------------------------------------------------------- hand-made


def test_hand_1f1b_sync_replaced_by_nop_after_recv(cases):
    c = cases["hand_1f1b"]
    assert seq(c) == [
        ("scale", ("x",), ("h",), None),
        ("c_sync_calc_stream", ("h",), ("h",), None),
        ("send_v2", ("h",), (), 20),
        ("recv_v2", (), ("h@GRAD",), 21),
        ("nop", ("h",), ("h",), None),
        ("scale", ("h@GRAD",), ("x@GRAD",), None),
    ]
    (removed,) = c["report"]["removed_syncs"]
    assert (removed["sync_index"], removed["send_index"], removed["recv_index"], removed["nop_index"]) == (3, 2, 4, 4)
    assert removed["ring_id"] == 20 and removed["var_names"] == ["h"]
    assert removed["peer"] == {"ring_id": 20, "ring_rank": 1, "endpoint": "127.0.0.1:6171", "global_rank": 1}
    assert "communicator setup" in removed["evidence"]
    assert c["report"]["inserted_nops"] == [{
        "index": 4, "recv_index": 4, "var_names": ["h"],
        "recv_peer": {"ring_id": 21, "ring_rank": 0, "endpoint": "127.0.0.1:6171", "global_rank": 1}}]
    assert c["report"]["notes"] == []
    idempotent(c)
    # the second run recognises the nop it inserted
    (existing,) = c["second"]["existing_nops"]
    assert existing["index"] == 4 and existing["verified"] is True


def test_hand_1f1b_without_comm_setup_falls_back_and_says_so(cases):
    c = cases["hand_1f1b_no_comm_setup"]
    assert seq(c) == seq(cases["hand_1f1b"])
    (removed,) = c["report"]["removed_syncs"]
    assert removed["evidence"] == "upstream 1F1B rule (peer stages unknown)"
    assert removed["peer"]["endpoint"] is None
    assert len(c["report"]["notes"]) == 1 and "upstream's 1F1B rule" in c["report"]["notes"][0]
    idempotent(c)


def test_hand_fthenb_left_alone(cases):
    for name, reason in [("hand_fthenb_schedule", "the schedule is F-then-B"),
                         ("hand_fthenb_no_recv", "no backward recv after the send")]:
        c = cases[name]
        unchanged(c)
        assert c["report"]["kept_sends"], name
        assert all(reason in k["reason"] for k in c["report"]["kept_sends"]), name
        idempotent(c)
    assert [k["send_index"] for k in cases["hand_fthenb_no_recv"]["report"]["kept_sends"]] == [2, 6]


def test_hand_recv_from_other_stage_left_alone(cases):
    for name in ("hand_recv_other_stage", "hand_same_ring_other_peer"):
        c = cases[name]
        unchanged(c)
        (kept,) = c["report"]["kept_sends"]
        assert "comes from another stage" in kept["reason"]
        assert "127.0.0.1:6170" in kept["reason"] and "127.0.0.1:6172" in kept["reason"]
        idempotent(c)
    # the sync is still right behind its send
    assert [o[0] for o in cases["hand_same_ring_other_peer"]["after"]][2:4] == ["send_v2", "c_sync_comm_stream"]


def test_hand_overwritten_sent_var_left_alone(cases):
    c = cases["hand_overwritten"]
    unchanged(c)
    (kept,) = c["report"]["kept_sends"]
    assert kept["reason"] == "h is written again by op #4 (scale) before the recv #5"


def test_hand_sync_that_guards_more_left_alone(cases):
    c = cases["hand_sync_guards_more"]
    unchanged(c)
    (kept,) = c["report"]["kept_sends"]
    assert "also guards other" in kept["reason"]


@pytest.mark.parametrize("name", ["hand_two_sends", "hand_two_sends_shared_sync"])
def test_hand_several_sends_one_nop(cases, name):
    c = cases[name]
    assert seq(c) == [
        ("scale", ("x",), ("h1",), None),
        ("scale", ("x",), ("h2",), None),
        ("c_sync_calc_stream", ("h1",), ("h1",), None),
        ("send_v2", ("h1",), (), 20),
        ("c_sync_calc_stream", ("h2",), ("h2",), None),
        ("send_v2", ("h2",), (), 20),
        ("recv_v2", (), ("h1@GRAD",), 21),
        ("nop", ("h1", "h2"), ("h1", "h2"), None),
        ("recv_v2", (), ("h2@GRAD",), 21),
        ("scale", ("h1@GRAD",), ("x@GRAD",), None),
    ]
    assert len(c["report"]["removed_syncs"]) == 2
    assert [n["var_names"] for n in c["report"]["inserted_nops"]] == [["h1", "h2"]]
    idempotent(c)


def test_hand_unrolled_micro_batches_hold_each_send_until_its_own_grad(cases):
    c = cases["hand_unrolled"]
    types = [(o[0], tuple(o[1])) for o in c["after"]]
    assert types == [
        ("scale", ("x0",)), ("c_sync_calc_stream", ("h0",)), ("send_v2", ("h0",)),
        ("scale", ("x1",)), ("c_sync_calc_stream", ("h1",)), ("send_v2", ("h1",)),
        ("recv_v2", ()), ("nop", ("h0",)), ("scale", ("h0@GRAD",)),
        ("scale", ("x2",)), ("recv_v2", ()), ("nop", ("h1",)), ("scale", ("h1@GRAD",)),
    ]
    idempotent(c)


# ----------------------------------------------------------------------------- real programs


@pytest.mark.parametrize("stages,rank", [(2, 0), (3, 0), (3, 1)])
def test_real_sending_stages_match_upstream_nop(cases, stages, rank):
    plain = cases[f"real_{stages}stage_rank{rank}_plain"]
    upstream = cases[f"real_{stages}stage_rank{rank}_upstream"]
    # the pass on a program Paddle did not optimise gives exactly upstream's optimised program
    assert plain["after"] == upstream["before"]
    assert plain["before"] != plain["after"]
    (removed,) = plain["report"]["removed_syncs"]
    (nop,) = plain["report"]["inserted_nops"]
    after = plain["after"]
    assert after[nop["index"]][0] == "nop" and after[nop["index"] - 1][0] == "recv_v2"
    assert after[nop["index"]][1] == removed["var_names"]
    assert removed["peer"]["global_rank"] == rank + 1
    assert "communicator setup" in removed["evidence"]
    assert [o[0] for o in after].count("c_sync_comm_stream") == [o[0] for o in plain["before"]].count(
        "c_sync_comm_stream") - 1
    idempotent(plain)
    # upstream's own nop is recognised, verified and left alone
    unchanged(upstream)
    (existing,) = upstream["report"]["existing_nops"]
    assert existing["verified"] is True and existing["var_names"] == removed["var_names"]
    assert any(k["reason"].startswith("already optimised") for k in upstream["report"]["kept_sends"])


def test_real_2stage_rank0_exact_sequence(cases):
    assert [o[0] for o in cases["real_2stage_rank0_plain"]["after"]] == [
        "mul", "elementwise_add", "relu", "c_sync_calc_stream", "send_v2", "recv_v2", "nop",
        "relu_grad", "elementwise_add_grad", "mul_grad", "fill_constant", "sum", "fill_constant", "sum",
        "sgd", "sgd"]
    nop = cases["real_2stage_rank0_plain"]["after"][6]
    assert nop[1] == nop[2] == ["fc_0.tmp_2"]


@pytest.mark.parametrize("name", ["real_2stage_rank1", "real_3stage_rank2"])
def test_real_last_stage_unchanged(cases, name):
    for suffix in ("_plain", "_upstream"):
        c = cases[name + suffix]
        unchanged(c)
        assert all("not a forward send" in k["reason"] for k in c["report"]["kept_sends"])


def test_real_without_comm_setup_falls_back(cases):
    c = cases["real_2stage_rank0_plain_no_comm_setup"]
    assert c["after"] == cases["real_2stage_rank0_plain"]["after"]
    assert "upstream's 1F1B rule" in " ".join(c["report"]["notes"])


def test_real_fthenb_unchanged(cases):
    c = cases["real_2stage_rank0_fthenb"]
    unchanged(c)
    (kept,) = c["report"]["kept_sends"]
    assert "calc stream" in kept["reason"]
