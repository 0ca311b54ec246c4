"""train.py with extra, test-only schedules registered: `python tests/schedule_probe.py TRAIN_FLAGS...`.

`gpipe-v` / `gpipe-interleaved`: every forward in stage order, then every fused backward in
reverse; the simplest orders that exercise the chunked engine on the V and interleaved
placements, independently of the real schedules' orders.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from schedules.chunked_engine import ChunkedEngine  # noqa: E402
from schedules.ordered import OrderedSchedule  # noqa: E402
from schedules.placement import InterleavedPlacement, VPlacement  # noqa: E402
from schedules.registry import available_schedules, register_schedule  # noqa: E402


class GPipeOrder(OrderedSchedule):

    @classmethod
    def check(cls, micro_batches, stages):
        pass

    def compute_order(self):
        chunks = sorted(range(self.placement.chunks), key=lambda c: self.placement.stage(self.stage_id, c))
        return self.forward_order() + [('BW', mb, c) for c in reversed(chunks) for mb in range(self.micro_batches)]


class GPipeV(GPipeOrder):
    name, placement_cls = "gpipe-v", VPlacement


class GPipeInterleaved(GPipeOrder):
    name, placement_cls = "gpipe-interleaved", InterleavedPlacement


available_schedules()
for cls in (GPipeV, GPipeInterleaved):
    register_schedule(cls.name, cls, cls.placement_cls, engine=ChunkedEngine)

if __name__ == "__main__":
    if os.environ.get("PROBE_DUMP_AFTER"):  # debugging a hang: print every thread's stack
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["PROBE_DUMP_AFTER"]), exit=True)
    train.run()
