"""The simulator's step for a traced training run (train.py --trace): the run's own passes, the collectives they
waited for and the engine's work between them, placed by the simulator on the run's schedule, plus what the run
spent outside its passes' span. What the benchmarks set beside a measured step.

    from schedules.observe.forecast import traced_forecast
    traced_forecast("run.json", step_s=0.81, wire=256 * 2**10 * 8 / 1e9)               # its own schedule
    traced_forecast("sequential.json", step_s, wire, overlap=True, comm_cpu=unthrottled)  # the same, pairs overlapped
"""
import statistics

from schedules.observe.trace import (
    communication_costs,
    communication_shapes,
    load_chrome_trace,
    load_p2p_events,
    measured_dispatch,
)
from schedules.simulator.simulate import simulate

LINK_LATENCY = 1e-4  # a small message's one-way time between two ranks over TCP, seconds


def traced_forecast(path, step_s, wire=0.0, latency=None, overlap=False, comm_cpu=None):
    """Seconds per step the simulator predicts for the run traced in `path` (its schedule, stages and
    micro-batches from the trace's meta) whose measured median step is `step_s`:

    - each pass's computation and the collectives it had in flight (trace.communication_costs: the run must have
      run its passes one at a time, --overlap off where the schedule pairs them), the engine's own work per pass
      (trace.measured_dispatch);
    - each pipeline message holding its link for `wire` seconds (its bytes over the link's rate), arriving
      `latency` after that (None: LINK_LATENCY), a send returning after `latency` (gloo's sockets take it);
    - `overlap`: the schedule's forward-backward pairs computing while the other's collectives are in flight, with
      `comm_cpu` (communication_costs' comm of a run over a free link) the part no turn hides (simulate's), each
      pair priced turn by turn from its passes' traced shapes (trace.communication_shapes);
    - plus what the run spent outside its passes' span (the optimizer step, the gradients' all-reduce), the
      measured step less the traced steps' median span."""
    costs, comm = communication_costs(path)
    timeline, _ = load_chrome_trace(path)
    dispatch = measured_dispatch(timeline, load_p2p_events(path))
    outside = step_s - statistics.median(t1 - t0 for t0, t1 in map(timeline.span, timeline.iterations()))
    meta, latency = timeline.meta, LINK_LATENCY if latency is None else latency
    return simulate(meta["schedule"], meta["stages"], meta["micro_batches"], costs=costs, comm=comm,
                    overlap=overlap, comm_cpu=comm_cpu, dispatch=dispatch,
                    comm_shape=communication_shapes(path) if overlap else None, iterations=1, latency=latency + wire,
                    wire=wire, send_wait=latency).makespan + outside
