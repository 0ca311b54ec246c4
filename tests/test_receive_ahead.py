"""ReceiveAhead posts each channel's next receive as soon as it can, in the schedule's order."""
import pytest
import torch

import schedules.runtime.receive_ahead as ra


class FakeComm:
    def __init__(self):
        self.posted = []  # (src, group, shape) in posting order

    def irecv(self, x, src, group=None):
        self.posted.append((src, group, tuple(x.shape)))
        x.fill_(len(self.posted))
        return type("Work", (), {"wait": lambda self: None})()


@pytest.fixture
def comm(monkeypatch):
    fake = FakeComm()
    monkeypatch.setattr(ra, "dist", fake)
    return fake


def test_streams_are_posted_ahead_once_their_shape_is_known(comm):
    ahead = ra.ReceiveAhead("cpu")
    c = (1, None)
    ahead.start([(c, "a"), (c, "b"), (c, "a"), ((0, None), "g")])
    assert comm.posted == []  # no shapes known yet
    first = ahead.receive(c, "a", lambda: torch.zeros(2, 3))
    assert first.shape == (2, 3) and comm.posted == []  # next on c is "b", shape unknown
    ahead.receive(c, "b", lambda: torch.zeros(4))
    assert comm.posted == [(1, None, (2, 3))]  # "a" again: posted right after "b" arrived
    x = ahead.receive(c, "a", lambda: pytest.fail("must come from the posted receive"))
    assert float(x[0, 0]) == 1.0
    ahead.start([(c, "a"), (c, "b")])  # next step: both shapes known, the first posted at once
    assert comm.posted[1:] == [(1, None, (2, 3))]
    ahead.receive(c, "a", None)
    assert comm.posted[2:] == [(1, None, (4, ))]


def test_a_receive_out_of_the_schedules_order_is_an_error(comm):
    ahead = ra.ReceiveAhead("cpu")
    c = (1, None)
    ahead.start([(c, "a"), (c, "b")])
    with pytest.raises(RuntimeError, match="next receive on that channel is a"):
        ahead.receive(c, "b", lambda: torch.zeros(1))


def test_disabled_every_receive_is_posted_when_its_instruction_runs(comm):
    ahead = ra.ReceiveAhead("cpu", enabled=False)  # NCCL
    c = (1, None)

    def receives():  # the engine walks its schedule lazily: disabled, not at all
        pytest.fail("a disabled ReceiveAhead must not consume the step's receives")
        yield

    ahead.start(receives())
    ahead.receive(c, "a", lambda: torch.zeros(3))
    assert comm.posted == []
    x = ahead.receive(c, "a", lambda: pytest.fail("the shape is known: a plain receive"))
    assert comm.posted == [(1, None, (3, ))] and float(x[0]) == 1.0
