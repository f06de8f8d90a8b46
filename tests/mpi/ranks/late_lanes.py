"""Copy lanes for the CPU that run every copy late, the way a GPU's copy engines may: a copy
(or device work, `run`) is queued on its lane and runs only when an event recorded after it is waited for (or when a
later copy on another lane was told to wait for it, or at `finish`).  Driving the staged
all-reduce's schedule (psrt/collectives/staged.py) with these, a missing wait leaves a host
slot stale or overwritten, and the sum comes out wrong."""
from __future__ import annotations


class LateLanes:
    def __init__(self, device=None):
        self.queues = {"down": [], "up": []}
        self.done = {"down": 0, "up": 0}
        self.log: list[str] = []          # every copy in the order it ran: "down" / "up"

    def begin(self) -> None:
        self.log.append("begin")

    def copy(self, lane: str, dst, src, after=None):
        queue = self.queues[lane]
        if after is not None:
            queue.append(("wait", after))
        queue.append(("copy", dst, src))
        return lane, len(queue)           # the event: the lane's first len(queue) entries done

    def run(self, lane: str, work):
        self.queues[lane].append(("call", work))
        return lane, len(self.queues[lane])

    def wait(self, event) -> None:
        lane, upto = event
        queue = self.queues[lane]
        while self.done[lane] < upto:
            entry = queue[self.done[lane]]
            self.done[lane] += 1
            if entry[0] == "wait":
                self.wait(entry[1])
            elif entry[0] == "call":
                entry[1]()
                self.log.append(lane + " work")
            else:
                entry[1].copy_(entry[2])
                self.log.append(lane)

    def finish(self, written) -> None:
        for lane, queue in self.queues.items():
            self.wait((lane, len(queue)))
        self.log.append("finish")
