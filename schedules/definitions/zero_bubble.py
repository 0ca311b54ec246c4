"""ZB-H1 and ZB-H2, the handcrafted schedules of "Zero Bubble Pipeline Parallelism" (Qi et al., ICLR 2024).

Both split each backward into B (input gradients, on the critical path) and W (weight
gradients, deferred) and place the W passes where 1F1B would leave a stage idle. p stages,
m micro-batches, stage i (0 = first). Unit costs F = B = W = 1:

- ZB-H1: 1F1B's order of F and B, 1F1B's peak activation memory (stage i holds at most p - i
  micro-batches), and stage i holds its first i W passes back so they fill its cool-down:
  bubble (p-1)(F + B - W) = p - 1, a third of 1F1B's 3(p-1).
- ZB-H2: more forwards in the warm-up (2(p-1-i) + 1 before stage i's first B, so up to 2p-1
  micro-batches are in flight on the first stage), and the last 2i W passes of stage i left to
  its end: the stages form a parallelogram, and consecutive iterations interlock with zero
  bubble when the optimizer step does not synchronise the stages.

Both are written as lags: in its steady state stage i runs F of micro-batch x, B of x - b_lag
and W of x - w_lag (see LaggedSchedule).
"""
from schedules.lowering import OrderedSchedule
from schedules.passes import Action, B, F, W
from schedules.placement import SplitBackwardPlacement


class LaggedSchedule(OrderedSchedule):
    """Stage i repeats the triple (F x, B x - b_lag(i), W x - w_lag(i)) for x = 0, 1, ...,
    leaving out the passes whose micro-batch is outside 0..m-1. The lags alone give the phases:

        warm-up 1: F alone              (x < b_lag)
        warm-up 2: F B                  (b_lag <= x < w_lag)
        steady:    F B W
        cool-down 1: B W                (x >= m, B still in range)
        cool-down 2: W alone            (the held-back W passes)
    """

    @classmethod
    def check(cls, micro_batches, stages):
        super().check(micro_batches, stages)
        need = cls.min_micro_batches(stages)
        if micro_batches < need:
            raise ValueError(f"{cls.name} with {stages} stages needs at least {need} micro-batches per step "
                             f"(--gradient-accumulation-steps >= {need}), got {micro_batches}")

    @classmethod
    def min_micro_batches(cls, stages):
        raise NotImplementedError

    def lags(self):
        """(b_lag, w_lag) of this stage."""
        raise NotImplementedError

    placement_cls = SplitBackwardPlacement  # the split-backward engine: rank r runs stage r

    def compute_order(self):
        m = self.micro_batches
        b_lag, w_lag = self.lags()
        order = []
        for x in range(m + w_lag):
            order += [Action(kind, x - lag) for kind, lag in ((F, 0), (B, b_lag), (W, w_lag)) if 0 <= x - lag < m]
        return order


class ZBH1Schedule(LaggedSchedule):
    """1F1B's lag of B behind F (p-1-i, so 1F1B's memory), and every W p-1 behind its F."""
    name = "zb-h1"

    @classmethod
    def min_micro_batches(cls, stages):
        return stages  # fewer leave the steady state empty: a different, worse schedule

    def lags(self):
        p, i = self.stages, self.stage_id
        return p - 1 - i, p - 1


class ZBH2Schedule(LaggedSchedule):
    """Twice the lags of ZB-H1: the first stage holds up to 2p-1 micro-batches."""
    name = "zb-h2"

    @classmethod
    def min_micro_batches(cls, stages):
        return 2 * stages - 1  # enough forwards to fill the warm-up of the first stage

    def lags(self):
        p, i = self.stages, self.stage_id
        return 2 * (p - 1 - i), 2 * (p - 1)

