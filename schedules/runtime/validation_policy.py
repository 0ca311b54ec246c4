"""When a post-validated step (interlock.py) goes ahead of the model's gradient norm, and when `auto` speculates
past it.

Two decisions, of different reach:
- AheadPolicy, per rank: a rank whose own norm does not clip steps before the norm arrives (a backup first, a
  rollback if the norm clips) or waits for it. Either way it validates before its next instruction stream, so
  the decision is its own: no other rank needs to know it.
- SpeculationVote, per pipeline: whether the next step's passes run before the step is validated. A step redone
  then means the next step's passes ran on the wrong parameters and must run again, on every rank, or the
  messages of the two runs would not pair. So `auto` decides it from figures every rank holds alike: each rank's
  wait for the norm, backup time and step time, gathered by one all-reduce beside the norm's, and the clip
  history of the model's norms.
"""
from collections import deque

import torch

POLICIES = ("auto", "ahead", "wait", "speculate")


class AheadPolicy:
    """Whether a rank whose own norm does not clip steps before the model's norm arrives (`ahead`: backup, step,
    roll back if the model's norm clips) or waits for it (`wait`: no backup, never a rollback). Both train the
    same; only time differs. Stepping ahead saves the rank the wait for the norm (T, from the norm's all-reduce
    being started to its result) and costs a backup (B): it pays when T > B. `auto` decides per rank from what
    the last step showed:
    - stepped ahead: was the norm already there when the backup was done? Then T <= B: wait next time;
    - waited: T > B? (T is exact when the validation had to wait for the result; when the result was already
      there, T is at most the time elapsed, and that bound decides only if no step ahead has said otherwise).
    The first step goes ahead, which measures B."""

    def __init__(self, policy="auto"):
        if policy not in POLICIES:
            raise ValueError(f"post-validation policy '{policy}': choose from {', '.join(POLICIES)}")
        self.policy, self.backup_s, self.ahead, self._ahead_paid = policy, None, True, None

    def steps_ahead(self):
        return self.ahead if self.policy == "auto" else self.policy in ("ahead", "speculate")

    def backed_up(self, seconds, norm_arrived):
        """A step ahead: its backup took `seconds`, and by then the norm had (not) arrived."""
        self.backup_s, self._ahead_paid = seconds, not norm_arrived
        self.ahead = self._ahead_paid

    def waited_for_norm(self, elapsed, waited):
        """A step that waited: the norm was in hand `elapsed` seconds after its all-reduce began; `waited`:
        whether the validation had to wait for it (else it had arrived earlier, at an unknown time)."""
        if self.backup_s is None:
            self.ahead = True
        elif waited:
            self.ahead = elapsed > self.backup_s
        else:
            self.ahead = elapsed > self.backup_s and self._ahead_paid is not False


class SpeculationVote:
    """`auto`'s decision to speculate past a step, the same on every rank.

    Speculating saves a rank its wait for the norm before its next stream (W) and costs a backup (B) each step
    and, whenever the model's norm redoes a step (it clips, or is not finite), a replay of the next one: about a
    step (S). The pipeline runs at the pace of its slowest rank, so the figures are the largest over ranks, and
    `auto` speculates past a step while

        max W > max B + clip rate x max S

    the clip rate being the share of the last HISTORY validated steps that the model's norm redid. Each rank
    casts its own W, B and S at its OptimizerStep (`ballot`: a vector with a slot per rank, summed by an
    all-reduce over every rank, data-parallel replicas included, since they replay together); the sums arrive
    with the step's validation (`counted`), which every rank performs for the same steps, in the same order. So
    a decision taken at a step, from the votes and validations of the steps before, is every rank's.

    W is measured where a rank validates before its next stream. While speculating it is not waited for: a
    rank that finds the norm already in at its next stream's start casts 0 (nothing to save), else its last
    measurement; and after PROBE_AFTER steps speculated past in a row the next one is not (a probe), so that
    a wait that shrank meanwhile is measured again. The first steps, with nothing measured, do not speculate.
    `rule` (a function of the vote) may be replaced, as long as it reads only what every rank holds alike (the
    tests alternate)."""

    HISTORY = 16
    PROBE_AFTER = 16  # a probe costs one step's wait in 17: the gain shrinks by about 6% of it

    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.norm_wait_s = None  # this rank's last wait for the norm before a stream
        self.step_s = None       # this rank's last time from one OptimizerStep to the next
        self._step_at = None
        self.redone = deque(maxlen=self.HISTORY)  # per validated step: the model's norm redid it (every rank alike)
        self.validated = 0
        self.figures = None  # the last vote's (W, B, S): each the largest over ranks
        self.in_a_row = 0    # steps speculated past in a row (every rank alike: the decisions are)
        self.rule = SpeculationVote.pays

    def step_at(self, now):
        """This rank reached an OptimizerStep at `now` (perf_counter seconds)."""
        if self._step_at is not None:
            self.step_s = now - self._step_at
        self._step_at = now

    def waited(self, seconds):
        """This rank waited `seconds` for the norm before its next stream."""
        self.norm_wait_s = seconds

    def speculated_and_found(self, arrived):
        """Speculating, this rank's next stream starts: had the norm arrived already (nothing saved)?"""
        if arrived:
            self.norm_wait_s = 0.0

    def ballot(self, backup_s):
        """This rank's (W, B, S), in its slots of a vector of every rank's: summed over ranks, each slot is one
        rank's."""
        ballot = torch.zeros(3 * self.world, dtype=torch.float64)
        for i, value in enumerate((self.norm_wait_s, backup_s, self.step_s)):
            ballot[i * self.world + self.rank] = value or 0.0
        return ballot

    def counted(self, totals):
        """The summed ballots of a step arrived."""
        self.figures = tuple(float(totals[i * self.world:(i + 1) * self.world].max()) for i in range(3))

    def validated_step(self, redone):
        """A step was validated: `redone`, the model's norm clipped it or found it not finite."""
        self.redone.append(bool(redone))
        self.validated += 1

    def clip_rate(self):
        return sum(self.redone) / len(self.redone) if self.redone else 0.0

    def speculates(self):
        """Whether to speculate past this step (called once per step, on every rank alike)."""
        speculate = self.rule(self) and self.in_a_row < self.PROBE_AFTER
        self.in_a_row = self.in_a_row + 1 if speculate else 0
        return speculate

    @staticmethod
    def pays(vote):
        if vote.figures is None:  # nothing measured yet
            return False
        wait_s, backup_s, step_s = vote.figures
        return wait_s > backup_s + vote.clip_rate() * step_s
