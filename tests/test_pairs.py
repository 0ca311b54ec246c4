"""The simulator's overlapped pair taken turn by turn (schedules/simulator/pairs.py): it agrees with the closed form
max(a1, c2) + max(a2, c1) where the passes' pieces are even, costs more where a pass's computation sits in one
piece (GPTlite's last stage: the head), and never double-counts the core's own part of a collective."""
import pytest

from schedules.simulator.pairs import pair_ends, scaled


def test_even_pieces_take_the_closed_form():
    first = second = ([1.0, 1.0, 1.0], [0.5, 0.5])
    assert max(pair_ends(first, second)) == pytest.approx(max(3.0, 1.0) + max(3.0, 1.0))
    # the other pass's computation hides every collective: both end where their own work ends, one after the other
    assert pair_ends(first, second) == pytest.approx((5.0, 6.0))


def test_a_pass_alone_waits_for_its_collectives():
    first, second = ([1.0, 1.0], [2.0]), ([0.5], [])  # the second has no collective: it runs through in one turn
    assert pair_ends(first, second) == pytest.approx((4.0, 1.5))  # = max(2, 0) + max(0.5, 2)


def test_a_computation_in_one_piece_hides_less_than_the_totals_say():
    """The backward of GPTlite's last stage: the head's backward, then two MoE layers' all-to-alls; the forward
    of the first stage: six all-to-alls between short computations."""
    backward = ([0.200, 0.010, 0.005], [0.016, 0.016])
    forward = ([0.004] * 7, [0.016] * 6)
    closed = max(0.215, 0.096) + max(0.028, 0.032)  # 0.247
    ends = pair_ends(backward, forward)
    # the forward's first two collectives cross behind the backward's (0.216-0.232, 0.248-0.264), so the backward
    # ends at 0.253; the forward then runs alone, its last four collectives exposed in full: 0.268 + 4 x 0.020
    assert ends == pytest.approx((0.253, 0.348)) and max(ends) > closed + 0.1


def test_a_collective_issued_while_the_other_s_crosses_waits_for_the_link():
    """The two passes' collectives share the rank's link: the forward's, issued at 1 s while the backward's
    crosses until 3 s, crosses from 3 to 5 s, and the forward waits for it there, not at 3."""
    backward, forward = ([1.0, 0.5], [2.0]), ([0.0, 1.0], [2.0])
    # B computes to 1 and issues; F issues at once (behind B's, 3-5); B waits to 3, computes to 3.5 and ends;
    # F waits to 5 and computes to 6
    assert pair_ends(backward, forward) == pytest.approx((3.5, 6.0))


def test_the_cores_part_of_a_collective_is_not_counted_twice():
    """A collective that is all the core's work (an unthrottled link): the pair costs its passes one after the
    other, no more and no less; half the core's: in between."""
    def pair(kernel):
        return max(pair_ends(([1.0, 1.0], [0.5], [kernel]), ([1.0, 1.0], [0.5], [kernel])))
    assert pair(0.5) == pytest.approx(2 * (2.0 + 0.5))
    assert pair(0.0) == pytest.approx(4.0)
    assert 4.0 < pair(0.25) < 5.0


def test_a_shape_is_scaled_to_the_pass_s_costs():
    computes, collectives, kernels = scaled(([2.0, 1.0, 1.0], [1.0, 3.0]), 8.0, 2.0, 1.0)
    assert computes == pytest.approx([4.0, 2.0, 2.0]) and collectives == pytest.approx([0.5, 1.5])
    assert kernels == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError, match="one more computation than collectives"):
        pair_ends(([1.0], [1.0]), ([1.0], []))


def test_the_backward_s_weight_gradients_fill_what_both_passes_wait():
    """Backward 2 + 2 + 2 s around two 1.5 s collectives, forward 1 + 1 + 1 around two: the backward's collectives
    have 1 s of the forward to hide behind, so the pair waits (10 s). With 3 s of the backward's computation its
    deferred weight gradients, each piece of 2 s is 1 of B and leaves 1 to a pool, and the waits take from it:
    by hand, the forward's first collective, issued at 2.0, crosses behind the backward's (2.5-4.0); the backward
    resumes at 2.0 with its collective due at 2.5 (0.5 filled), the forward at 3.5 with its due at 4.0 (0.5), the
    backward at 5.0 with its second, issued at 3.5 behind the forward's, due at 5.5 (0.5), the forward at 6.5 with
    its second due at 7.0 (0.5); the backward ends at 6.5, the forward at 8, and the 1 s left runs after, 9 s.
    (A collective whose kernel holds the core leaves nothing to fill: tests/test_benchmark_overlap.py.)"""
    backward, forward = ([2.0, 2.0, 2.0], [1.5, 1.5]), ([1.0, 1.0, 1.0], [1.5, 1.5])
    assert pair_ends(backward, forward) == pytest.approx((9.0, 10.0))
    assert pair_ends(backward, forward, fill=3.0) == pytest.approx((9.0, 8.0))


def test_a_fused_backward_alone_fills_its_own_wait():
    """A lone BW of 1 + 1 s around a 2 s collective: 4 s; half its computation weight gradients, 0.5 s of them wait
    under the collective, 3.5 s (the simulator's lone passes: timing._with_comm)."""
    alone = ([0.0], [], [])
    assert pair_ends(([1.0, 1.0], [2.0]), alone)[0] == pytest.approx(4.0)
    assert pair_ends(([1.0, 1.0], [2.0]), alone, fill=1.0)[0] == pytest.approx(3.5)


def test_a_b_whose_own_w_comes_next_fills_its_wait_and_leaves_the_rest_to_the_w():
    """A B of 1 + 1 s around a 3 s collective, its W 2 s (so 4 s of computation, half of it weight gradients): the
    first second of B leaves 1 s of works, which run under the collective; the second leaves 1 s for the W. B ends
    at 5 s and its W takes 1 s, where one after the other took 5 + 2 (timing._own_weights)."""
    from schedules.simulator.pairs import alone_ends
    assert alone_ends(([2.0, 2.0], [3.0]), fill=2.0) == pytest.approx((5.0, 1.0))
    assert alone_ends(([2.0, 2.0], [3.0])) == pytest.approx((7.0, 0.0))
