"""The one table of pipeline schedules: name -> schedule class, where its chunks live, and which
engine and PipelineModule run it. `train.py --pipeline-schedule`, `schedules.initialize`, the
simulator, the table and the diagrams all read it.

Engines and modules are named here, not imported (the vocabulary must not depend on the
runtime): `schedules.runtime` resolves the names. A row's `engine` may also be a PipelineEngine
subclass of your own that takes `schedule_cls=` (as tests do with a recording engine).
"""
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

from deepspeed.runtime.pipe import schedule as ds

from schedules.definitions.controllable_memory import VHalfSchedule, VMinSchedule
from schedules.definitions.dualpipe import DualPipeSchedule
from schedules.definitions.interleaved import Interleaved1F1BSchedule
from schedules.definitions.vshape import DualPipeVSchedule, ZBVSchedule
from schedules.definitions.zero_bubble import ZBH1Schedule, ZBH2Schedule
from schedules.placement import ChunkedPlacement, DualPipeVPlacement, SplitBackwardPlacement, StockPlacement

# Engines (schedules/runtime/__init__.py resolves them); None: the one deepspeed.initialize picks.
SPLIT_BACKWARD, CHUNKED = 'split-backward', 'chunked'
# PipelineModules; None: from the placement (several chunks per rank: ChunkedPipelineModule, else
# the model's own PipelineModule, one stage per rank).
DEEPSPEED_DUALPIPEV_MODULE = 'deepspeed-dualpipev'


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    factory: Callable  # (micro_batches, stages, stage_id) -> PipeSchedule; may raise ValueError
    placement: type  # where chunks live, with the traits of the engine that runs it (the simulator's model)
    description: str = ''
    engine: Union[None, str, type] = None  # SPLIT_BACKWARD, CHUNKED, an engine class, or None: DeepSpeed's own
    trains: bool = True  # train.py can run it
    module: Optional[str] = None  # DEEPSPEED_DUALPIPEV_MODULE, or None: the one its placement needs


def _ours(cls, engine, description):
    """A row for one of our OrderedSchedule classes: its placement is the class's own."""
    return ScheduleSpec(cls.name, cls, cls.placement_cls, description, engine)


SCHEDULES = {spec.name: spec for spec in (
    ScheduleSpec('1f1b', ds.TrainSchedule, StockPlacement,
                 "DeepSpeed's TrainSchedule (1F1B) on its stock PipelineEngine"),
    ScheduleSpec('1f1b-lean', ds.TrainSchedule, SplitBackwardPlacement,
                 "DeepSpeed's TrainSchedule (1F1B) on our engine: asynchronous sends, receives posted ahead, the "
                 "lean step end, in-place gradient accumulation", SPLIT_BACKWARD),
    _ours(ZBH1Schedule, SPLIT_BACKWARD, "ZB-H1: 1F1B with deferred W filling the cool-down"),
    _ours(ZBH2Schedule, SPLIT_BACKWARD, "ZB-H2: extra warm-up forwards, zero bubble when iterations interlock"),
    _ours(Interleaved1F1BSchedule, CHUNKED, "Interleaved 1F1B (Megatron-LM): v chunks per rank, bubble / v"),
    _ours(ZBVSchedule, CHUNKED, "ZB-V: V placement, split backward, 1F1B memory"),
    _ours(DualPipeVSchedule, CHUNKED, "DualPipeV: DeepSeek's cut-in-half DualPipe, with deferred W"),
    _ours(VHalfSchedule, CHUNKED, "V-Half: V placement, split backward, about half of 1F1B's activation memory"),
    _ours(VMinSchedule, CHUNKED, "V-Min: V placement, split backward, about a third of 1F1B's activation memory"),
    _ours(DualPipeSchedule, CHUNKED, "DualPipe (DeepSeek-V3): bidirectional, two copies of each stage, deferred W"),
    ScheduleSpec('dualpipev-deepspeed', ds.DualPipeVSchedule, DualPipeVPlacement,
                 "DeepSpeed's DualPipeVSchedule on its DualPipeVEngine", module=DEEPSPEED_DUALPIPEV_MODULE),
)}


def register_schedule(name, factory, placement, description='', engine=None, trains=True, module=None):
    """Add a row (a schedule defined outside this package, e.g. in a test)."""
    SCHEDULES[name] = ScheduleSpec(name, factory, placement, description, engine, trains, module)


def available_schedules():
    """{name: ScheduleSpec} of every schedule."""
    return SCHEDULES


def trainable_schedules():
    """The names train.py can run, in table order."""
    return [name for name, spec in SCHEDULES.items() if spec.trains]


def schedule_spec(name, virtual_stages=None):
    """The registered schedule `name`; with `virtual_stages`, its variant with that many chunks per rank."""
    spec = SCHEDULES[name]
    if virtual_stages is None:
        return spec
    factory = spec.factory.with_virtual_stages(virtual_stages)
    return replace(spec, factory=factory, placement=factory.placement_cls)


def splits_vocabulary(spec, ranks=2):
    """Whether registry row `spec` can run a split vocabulary head (schedules/runtime/vocab_parallel.py) at
    `ranks` ranks: our chunked engine, one stream of micro-batches, and a last chunk whose `ranks` model stages
    sit on `ranks` different ranks, after at least one stage of the trunk (the V placement, interleaved)."""
    if spec.engine != CHUNKED or not issubclass(spec.placement, ChunkedPlacement):
        return False
    where = spec.placement(ranks)
    if any(where.direction(c) is not None for c in range(where.chunks)):
        return False  # the mirror: two copies of every stage, two streams
    stages = where.num_model_stages
    last = {where.owner(s)[0] for s in range(stages - ranks, stages)}
    return stages > ranks and len(last) == ranks


def splitting_schedules(ranks=2):
    """The registered schedule names that run a split head."""
    return [name for name, spec in SCHEDULES.items() if splits_vocabulary(spec, ranks)]
