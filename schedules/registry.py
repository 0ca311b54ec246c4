"""The one registry of pipeline schedules: name -> schedule class, the engine that runs it, and
the simulator's model of that engine. `train.py --pipeline-schedule`, `schedules.initialize`,
the simulator, the table and the diagrams all read it. A schedule registers itself with one
`register_schedule(...)` line next to its class.
"""
import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class ScheduleSpec:
    name: str
    factory: Callable  # (micro_batches, stages, stage_id) -> PipeSchedule; may raise ValueError
    placement: type  # the simulator's Placement subclass modelling the engine that runs it
    description: str = ''
    engine: Optional[type] = None  # PipelineEngine subclass taking schedule_cls=; None: DeepSpeed's own choice
    trains: bool = True  # train.py can run it
    module: Optional[Callable] = None  # (layers, **PipelineModule kwargs) -> the PipelineModule it needs

    @property
    def pipe_module(self):
        """What builds this schedule's PipelineModule: several chunks per rank where its placement has
        them; None for the models' own one-stage-per-rank PipelineModule."""
        if self.module is not None:
            return self.module
        from schedules.placement import ChunkedPlacement
        if issubclass(self.placement, ChunkedPlacement):
            from schedules.module import ChunkedPipelineModule
            return functools.partial(ChunkedPipelineModule, placement=self.placement)
        return None


SCHEDULES = {}


def register_schedule(name, factory, placement, description='', engine=None, trains=True, module=None):
    SCHEDULES[name] = ScheduleSpec(name, factory, placement, description, engine, trains, module)


def schedule_spec(name, virtual_stages=None):
    """The registered schedule `name`; with `virtual_stages`, its variant with that many chunks per rank."""
    spec = available_schedules()[name]
    if virtual_stages is None:
        return spec
    factory = spec.factory.with_virtual_stages(virtual_stages)
    return ScheduleSpec(name, factory, factory.placement_cls, spec.description, spec.engine, spec.trains, spec.module)


def available_schedules():
    """Import every module of the `schedules` package (so their registrations run); return the registry."""
    import schedules
    for mod in pkgutil.iter_modules(schedules.__path__):
        if mod.name not in ('plot', ):  # the renderer registers nothing and pulls in matplotlib
            importlib.import_module(f'schedules.{mod.name}')
    return SCHEDULES
