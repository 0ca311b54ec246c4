"""Receives posted ahead: each channel's next receive is posted as soon as the one before it completes.

Why: with asynchronous sends, a message often leaves before its receiver reaches the matching
RecvActivation / RecvGrad. gloo moves it only once the receive is posted, and then it needs the
sender's communication thread to get a core; with every rank computing on its own core that
wake-up costs milliseconds (measured here, two ranks both computing: a late receive took 3 ms at
the median, 0.01 ms when it had been posted before the send). Posting each receive early lets the
sender write the data straight away, and the receiver finds it there.

The order comes from the schedule itself: at the start of a step the engine lists its receive
instructions, mapped to (channel, stream). A channel (source rank, communicator) delivers its
messages in posting order, so its next receive is always the next entry of its list; a stream
(activations or gradients of one chunk) has one message spec (one tensor or a tuple of them, see
messages.py), learnt from its first receive. A receive is posted ahead only once its stream's spec
is known, and never more than one per channel, so at most one extra message per channel is
allocated early.

gloo only: NCCL runs a pair of ranks' sends and receives in posting order on one stream, so a
receive posted ahead would hold up the sends posted after it (and the wake-up cost it avoids is a
gloo one). Disabled, every receive is posted when its instruction runs.
"""
from collections import deque

from deepspeed import comm as dist

from schedules.runtime import messages


class ReceiveAhead:

    def __init__(self, device, enabled=True, same_spec=True):
        """`same_spec=False` (PipelineModule(dynamic_shape=True)): every message brings its own spec, so
        none is remembered and nothing can be posted ahead."""
        self.device, self.enabled, self.same_spec = device, enabled and same_spec, same_spec
        self.specs = {}   # stream -> the spec of its messages (messages.spec_of), from its first receive
        self.plan = {}    # channel -> deque of the streams still to arrive on it this step, in order
        self.posted = {}  # channel -> (stream, message, works) of the receive posted ahead

    def start(self, receives):
        """A new step whose receives are `receives`: (channel, stream) in instruction order, an
        iterable that is not consumed when disabled."""
        self.plan, self.posted = {}, {}
        for channel, stream in receives if self.enabled else ():
            self.plan.setdefault(channel, deque()).append(stream)
        for channel in self.plan:
            self._post_next(channel)

    def receive(self, channel, stream, first_recv):
        """The next message of `stream` on `channel`: the one posted ahead, else received now;
        `first_recv()` receives a stream's first message (and learns its spec however it must)."""
        if channel in self.posted:
            ahead, x, works = self.posted.pop(channel)
            if ahead != stream:
                raise RuntimeError(f"receive of {stream} from rank {channel[0]}, but the schedule's next receive "
                                   f"on that channel is {ahead}")
        else:
            queue = self.plan.get(channel)
            if queue:
                if queue[0] != stream:
                    raise RuntimeError(f"receive of {stream} from rank {channel[0]}, but the schedule's next "
                                       f"receive on that channel is {queue[0]}")
                queue.popleft()
            if stream in self.specs:
                x, works = self._irecv(channel, stream)
            else:
                x, works = first_recv(), ()
                if not self.same_spec:
                    return x
                self.specs[stream] = messages.spec_of(x)
        for work in works:
            work.wait()
        self._post_next(channel)
        return messages.restore(x, self.specs[stream])

    def _irecv(self, channel, stream):
        x = messages.empty(self.specs[stream], self.device)
        src, group = channel
        return x, [dist.irecv(t, src, group=group) for t in messages.tensors(x)]

    def _post_next(self, channel):
        queue = self.plan.get(channel)
        if queue and queue[0] in self.specs:
            stream = queue.popleft()
            self.posted[channel] = (stream, *self._irecv(channel, stream))
