"""tools/stage_memory.py's orders (its runs need a GPU)."""
from tools.diagnostics import stage_memory


def test_one_f_one_b_and_its_zero_bubble_split():
    assert stage_memory.one_f_one_b(0, 2, 4) == ["f0", "f1", "b0", "f2", "b1", "f3", "b2", "b3"]
    zb = stage_memory.zero_bubble(1, 2, 4)
    assert zb == ["f0", "i0", "f1", "i1", "w0", "f2", "i2", "w1", "f3", "i3", "w2", "w3"]
    for n in range(4):  # each micro-batch: forward, then input pass, then weight pass
        assert zb.index(f"f{n}") < zb.index(f"i{n}") < zb.index(f"w{n}")


def test_zero_bubble_order_refuses_the_first_stage(capsys):
    import pytest

    with pytest.raises(SystemExit):
        stage_memory.main(["--order", "zb", "--stages", "0,1"])
    assert "first stage has no input gradient" in capsys.readouterr().err
