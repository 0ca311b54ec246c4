"""Pipeline schedules for DeepSpeed, selected by name (`train.py --pipeline-schedule NAME`);
their simulator (simulate.py), timelines (timeline.py) and plots (plot.py).

`SCHEDULES` is the registry: name -> what the schedule is. `initialize(schedule, ...)` is the
one entry point that builds the engine a schedule needs and returns what
`deepspeed.initialize` returns; `deepspeed.initialize` itself cannot be told which engine
class to build.
"""
SCHEDULES = {
    "1f1b": "DeepSpeed's stock TrainSchedule (PipeDream-Flush 1F1B) on its stock PipelineEngine",
}


def initialize(schedule: str = "1f1b", **kwargs):
    """`deepspeed.initialize(**kwargs)` with the engine that runs `schedule`."""
    import deepspeed
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{schedule}': choose from {', '.join(SCHEDULES)}")
    return deepspeed.initialize(**kwargs)
