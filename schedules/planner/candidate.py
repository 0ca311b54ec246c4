"""One candidate of the chooser: a schedule (and v) on one cut of a profile's layers, simulated with the costs
composed from the profile (`simulated`), and what the chooser ranks it by (`Candidate`). See choose.py for how a
predicted step is made of the simulator's span and the time outside the schedule."""
from dataclasses import dataclass, field
from typing import Optional

from schedules.planner.compose import compose
from schedules.planner.profile import message_times
from schedules.simulator.simulate import simulate


@dataclass
class Candidate:
    schedule: str
    virtual_stages: Optional[int]
    cut: str  # the partition method (methods giving the same cut are joined by '=')
    parts: list  # layer boundaries of the model stages
    step: float = 0.0  # predicted seconds per step: span + outside (interlocked: the period of chained steps)
    span: float = 0.0  # the simulator's synchronised makespan
    outside: float = 0.0
    bubble: list = field(default_factory=list)  # idle fraction of the span per rank
    peak: list = field(default_factory=list)  # predicted peak activation bytes per rank
    params: list = field(default_factory=list)  # parameters per rank
    synchronised: float = 0.0  # predicted seconds per step with a synchronised step end (span + outside)
    vocab_parallel: bool = False  # the head split over the ranks (train.py --vocab-parallel)
    # its slices' layout fitted to this schedule (planner.layout.Fitted), or None where slice_layout's
    vocab_layout: Optional[object] = None

    @property
    def label(self):
        return (self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages else "")
                + (" +vocab" if self.vocab_parallel else ""))

    @property
    def method(self):
        """The partition method to build the model with (the first of equivalent ones)."""
        return self.cut.split('=')[0]


def simulator_inputs(profile, figures):
    """simulate's keyword arguments for `compose`'s `figures` of `profile`: costs, memory, the links' times
    (message_times), the engine's own work, and the experts' all-to-alls (DualPipe's copies sharing them),
    overlapped in its pairs unless the run profiled turns it off."""
    p2p = profile.p2p
    return dict(costs=figures['costs'], memory=figures['memory'], p2p_cpu=(p2p['send'], p2p['recv']),
                dispatch=profile.dispatch, comm=figures['comm'], overlap=profile.meta.get('overlap', True),
                **message_times(p2p, figures['message_bytes']))


def simulated(profile, spec, v, method, parts, placement, micro_batches, interlock=1, validation="wait"):
    """The Candidate of registry row `spec` (v virtual stages) on the cut `parts` (by `method`) of `profile`'s
    layers, `placement` an instance for the run's ranks. DeepSpeed's own engines (no engine of ours in the row)
    synchronise every step: `interlock` counts only on ours."""
    interlock = interlock if spec.engine is not None else 1
    figures = compose(profile, placement, parts)
    common = dict(placement=spec.placement, **simulator_inputs(profile, figures))
    result = simulate(spec.factory, placement.ranks, micro_batches, iterations=1, **common)
    outside = max(figures['outside'])
    bubble = [row['idle_synced'] / result.makespan for row in result.per_rank]
    step = result.makespan + outside
    if interlock > 1:  # chained: each rank's step in its own stream, validated as the policy does
        chained = simulate(spec.factory, placement.ranks, micro_batches, iterations=max(3, interlock),
                           step_cost=dict(enumerate(figures['outside'])), validation=validation, **common)
        step = chained.period
        bubble = [row['idle_interlocked'] / chained.period for row in chained.per_rank]
    return Candidate(spec.name, v, method, parts, step, result.makespan, outside, bubble,
                     [row['peak_activation_memory'] for row in result.per_rank], figures['params'],
                     result.makespan + outside)
