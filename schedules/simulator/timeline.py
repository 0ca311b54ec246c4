"""What a pipeline schedule did, rank by rank: the common format of simulated and traced runs.

A `Timeline` holds, for every pipeline rank, the compute passes it ran in start order. The
simulator (simulate.py) produces one in unit costs ('F': a forward of one micro-batch through
one 1F1B stage costs 1); a traced real run can produce one in seconds ('s'). The renderer
(plot.py) and the metrics below only read this format, so both kinds are drawn and measured
the same way. Communication is not recorded: on a timeline it is the gap between passes.
"""

import json
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class Pass:
    kind: str  # one of schedules.passes.KINDS: F, B, W, BW
    stage: int  # global model stage the pass runs (0 .. number of stages - 1)
    chunk: int  # index among the rank's chunks (0 or 1 today), used for shading
    micro_batch: int  # index within its iteration (0 .. M - 1)
    start: float
    end: float
    direction: Optional[int] = None  # which end of the pipeline a bidirectional schedule fed it from
    pair: Optional[int] = None  # passes sharing an id ran as one unit (e.g. a forward overlapped with a backward)
    iteration: int = 0  # which training step, when several run back to back

    @property
    def duration(self):
        return self.end - self.start


@dataclass
class Timeline:
    ranks: list  # ranks[r] = list of Pass, in start order
    units: str = 'F'  # 'F': multiples of one 1F1B-stage forward; 's': seconds
    meta: dict = field(default_factory=dict)  # free-form: schedule name, stages, micro_batches, ...

    @property
    def num_ranks(self):
        return len(self.ranks)

    def passes(self, iteration=None):
        """All (rank, pass) pairs, optionally of one iteration only."""
        return [(r, p) for r, row in enumerate(self.ranks) for p in row
                if iteration is None or p.iteration == iteration]

    def iterations(self):
        return sorted({p.iteration for row in self.ranks for p in row})

    def span(self, iteration=None):
        """(first start, last end) over all ranks."""
        passes = [p for row in self.ranks for p in row if iteration is None or p.iteration == iteration]
        if not passes:
            return (0.0, 0.0)
        return (min(p.start for p in passes), max(p.end for p in passes))

    def busy(self, rank, iteration=None):
        return sum(p.duration for p in self.ranks[rank] if iteration is None or p.iteration == iteration)

    def to_dict(self):
        return {'units': self.units, 'meta': dict(self.meta),
                'ranks': [[asdict(p) for p in row] for row in self.ranks]}

    @classmethod
    def from_dict(cls, data):
        return cls(ranks=[[Pass(**p) for p in row] for row in data['ranks']],
                   units=data.get('units', 'F'),
                   meta=dict(data.get('meta', {})))

    def to_json(self, **kwargs):
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))

    def save(self, path):
        with open(path, 'w') as f:
            f.write(self.to_json(indent=1))

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls.from_json(f.read())
