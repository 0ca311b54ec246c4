"""The experts' exchange posts its receives before its sends on gloo (schedules/runtime/all_to_all.py), and moves
the same data as torch's all_to_all_single."""
import json

import pytest
import torch

import schedules.runtime.all_to_all as a2a
from local_launch import launch


class FakeDist:
    """Records the order in which the exchange posts its receives and sends (a group of `ranks`, this rank `me`)."""

    def __init__(self, ranks, me, backend="gloo"):
        self.ranks, self.me, self.backend, self.posted = ranks, me, backend, []

    def get_backend(self, group):
        return self.backend

    def get_world_size(self, group):
        return self.ranks

    def get_rank(self, group):
        return self.me

    def irecv(self, x, group=None, group_src=None):
        self.posted.append(("recv", group_src, x.shape[0]))
        return self._work()

    def isend(self, x, group=None, group_dst=None):
        self.posted.append(("send", group_dst, x.shape[0]))
        return self._work()

    def all_to_all_single(self, out, x, group=None, async_op=False):
        self.posted.append(("all_to_all_single",))
        return self._work()

    @staticmethod
    def _work():
        return type("Work", (), {"wait": lambda self: None, "is_completed": lambda self: True})()


@pytest.mark.parametrize("ranks,me", [(2, 0), (2, 1), (4, 2)])
def test_every_receive_is_posted_before_any_send(monkeypatch, ranks, me):
    fake = FakeDist(ranks, me)
    monkeypatch.setattr(a2a, "dist", fake)
    x = torch.arange(ranks * 6.0).reshape(2 * ranks, 3)
    out = torch.zeros_like(x)
    work = a2a.post_all_to_all(out, x, group="experts")
    assert work.wait() and work.is_completed()
    peers = [(me + k) % ranks for k in range(1, ranks)]
    assert fake.posted == [("recv", p, 2) for p in peers] + [("send", p, 2) for p in peers]
    assert torch.equal(out.chunk(ranks)[me], x.chunk(ranks)[me])  # its own share stays, copied


def test_nccl_keeps_torch_s_all_to_all(monkeypatch):
    fake = FakeDist(2, 0, backend="nccl")  # receives first on every rank would wait for each other there
    monkeypatch.setattr(a2a, "dist", fake)
    a2a.post_all_to_all(torch.zeros(2, 3), torch.ones(2, 3), group="experts")
    assert fake.posted == [("all_to_all_single",)]


def test_unequal_splits_are_refused(monkeypatch):
    monkeypatch.setattr(a2a, "dist", FakeDist(4, 0))
    with pytest.raises(ValueError, match="multiple of 4"):
        a2a.post_all_to_all(torch.zeros(6, 3), torch.ones(6, 3), group="experts")


@pytest.mark.multiprocess
def test_it_moves_what_torch_s_all_to_all_moves():
    run = launch(3, [], script="tests/all_to_all_probe.py", timeout=90)
    assert run.ok, run.explain()
    for rank, out in enumerate(run.stdout):
        seen = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        assert set(seen) == ({"world-3", "world-12"} | ({"pair-2", "pair-8"} if rank != 1 else set())), seen
        assert all(all(checks) for checks in seen.values()), seen
