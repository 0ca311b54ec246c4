"""V-Half and V-Min (schedules/definitions/controllable_memory.py) are the paper's building block repeated:
every order runs in the simulator without deadlock for a grid of p and m, each extra micro-batch adds one
period of the block to every rank's steady state, and a (p, m) they cannot run is refused in one line naming
the flag and the minimum, by the class and by train.py. Their closed forms are in tests/test_closed_forms.py.
Fast tier: no processes."""
import pytest

from schedules.definitions import controllable_memory as cm
from schedules.passes import B, F, W
from schedules.simulator.simulate import simulate
from training import TINY, assert_one_error_line, run_in_process

NAMES = ["v-half", "v-min"]


@pytest.mark.parametrize("name", NAMES)
def test_no_deadlock_for_a_grid_of_p_and_m(name):
    for p in range(2, 9):
        least = cm.min_micro_batches(name, p)
        for m in sorted({least, least + 1, least + 2, 2 * p, 2 * p + 3}):
            result = simulate(name, p, m, iterations=1)  # raises ScheduleError on a deadlock or a misused buffer
            assert all(row["busy"] == pytest.approx(3 * m) for row in result.per_rank)


@pytest.mark.parametrize("name", NAMES)
def test_the_minimum_is_where_the_steady_state_begins(name):
    # rank 0's first B0 - its first F0, in periods, + 2: V-Half 2 floor(p/2) + 2, V-Min floor(2p/3) + 2
    expected = {"v-half": lambda p: 2 * (p // 2) + 2, "v-min": lambda p: 2 * p // 3 + 2}[name]
    assert [cm.min_micro_batches(name, p) for p in range(2, 17)] == [expected(p) for p in range(2, 17)]


@pytest.mark.parametrize("name", NAMES)
def test_blocks_never_collide(name):
    for p in range(2, 13):
        for rank, slots in cm.building_block(name, p).items():
            assert len({t % cm.PERIOD for t in slots.values()}) == 4, (p, rank, slots)


def _periodic_run(order):
    """Longest run of passes each followed, cm.PERIOD passes later, by the same pass of the next micro-batch."""
    best = run = 0
    for a, b in zip(order, order[cm.PERIOD:]):
        run = run + 1 if (a.kind, a.chunk, a.micro_batch + 1) == (b.kind, b.chunk, b.micro_batch) else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [2, 3, 4, 7, 8])
def test_each_micro_batch_adds_one_block_to_the_steady_state(name, p):
    m = cm.min_micro_batches(name, p) + 2  # from here on (p <= 8) the steady state is the longest periodic run
    for rank in range(p):
        short, long = (cm.controllable_memory_order(name, p, n, rank) for n in (m, m + 4))
        assert _periodic_run(long) - _periodic_run(short) == 4 * cm.PERIOD, rank
        steady = long[len(long) // 2:][:cm.PERIOD]  # one period from the middle: each of the six passes once
        assert sorted((a.kind, a.chunk) for a in steady) == sorted([(F, 0), (F, 1), (B, 1), (B, 0), (W, 1), (W, 0)])


@pytest.mark.parametrize("cls", [cm.VHalfSchedule, cm.VMinSchedule])
def test_bad_p_or_m_is_one_line_naming_the_flag(cls):
    with pytest.raises(ValueError) as error:
        cls.check(micro_batches=8, stages=1)
    assert "\n" not in str(error.value) and "--pipeline-parallel-size >= 2" in str(error.value)
    least = cm.min_micro_batches(cls.name, 4)
    with pytest.raises(ValueError) as error:
        cls(least - 1, 4, 0)
    message = str(error.value)
    assert "\n" not in message and f"--gradient-accumulation-steps >= {least}" in message and "4 ranks" in message
    cls(least, 4, 0)  # the minimum itself runs
    with pytest.raises(ValueError, match="rank 4 outside"):
        cm.check_controllable_memory(cls.name, 4, least, rank=4)


@pytest.mark.parametrize("name", NAMES)
def test_train_py_refuses_too_few_micro_batches_in_one_line(name, monkeypatch, capsys):
    least = cm.min_micro_batches(name, 2)
    flags = ["--pipeline-parallel-size", "2", "--pipeline-schedule", name, "--gradient-accumulation-steps",
             str(least - 1), *TINY]
    status, stderr, _ = run_in_process(flags, monkeypatch, capsys, world=2, env={"HF_HUB_OFFLINE": "1"})
    assert_one_error_line(status, stderr, f"--gradient-accumulation-steps >= {least}")
