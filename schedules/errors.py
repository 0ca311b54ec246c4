"""The error a schedule that cannot run raises wherever it is found out (simulator, placement, engine)."""


class ScheduleError(Exception):
    """A schedule that deadlocks, breaks the p2p protocol, misuses its buffers, or asks an engine for
    an instruction it cannot run. The message names the rank, the step and the instruction."""
