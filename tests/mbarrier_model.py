"""The part of the simulated Hopper GPU that `test_hopper_walk.py` (the forward's overlapped
walk) and `test_hopper_backward_sim.py` (the backward's kernels) share: threads failing
together, mbarriers as Mosaic GPU uses them, and `pl.when` / `pl.loop` run eagerly.

An mbarrier completes a phase at a fixed number of arrivals. A wait is `try_wait.parity` on the
waiter's own parity bit (flipped at every wait, as Mosaic GPU tracks it per thread), so a
barrier that runs two phases ahead of a waiter is a protocol error, and a wait that never
completes is a deadlock (a timeout here)."""

import threading


class ProtocolError(AssertionError):
    pass


class Machine:
    """What the simulated threads of one CTA share: a condition variable, the errors any thread
    reported (the others then stop at their next wait), each thread's barrier parities."""

    def __init__(self, timeout_s: float):
        self.cv = threading.Condition()
        self.errors = []
        self.local = threading.local()
        self.timeout_s = timeout_s

    def fail(self, message):
        self.errors.append(message)
        with self.cv:
            self.cv.notify_all()
        raise ProtocolError(message)

    def parities(self):
        if not hasattr(self.local, "parities"):
            self.local.parities = {}
        return self.local.parities


class Barrier:
    def __init__(self, machine, name, arrivals):
        self.m, self.name, self.arrivals = machine, name, arrivals
        self.count = 0
        self.completed = 0

    def arrive(self):
        with self.m.cv:
            self.count += 1
            if self.count == self.arrivals:
                self.count = 0
                self.completed += 1
                self.m.cv.notify_all()

    def wait(self):
        waits = self.m.parities().get(id(self), 0)
        with self.m.cv:
            ok = self.m.cv.wait_for(
                lambda: self.m.errors or self.completed > waits, timeout=self.m.timeout_s)
            if self.m.errors:
                raise ProtocolError("another thread failed")
            if not ok:
                self.m.fail(f"{threading.current_thread().name}: deadlock waiting on "
                            f"{self.name} (wait {waits + 1}, {self.completed} phases done)")
            if self.completed > waits + 1:
                self.m.fail(f"{threading.current_thread().name}: {self.name} ran "
                            f"{self.completed - waits} phases ahead of this waiter's parity")
        self.m.parities()[id(self)] = waits + 1


class Indexed:
    """`x.at[i]` for barrier groups (and the forward's shared-memory slot arrays)."""

    def __init__(self, items):
        self.items = items

    @property
    def at(self):
        return self

    def __getitem__(self, i):
        return self.items[int(i)]


def when(pred):
    """`pl.when`, eagerly: the decorated function runs at once if `pred` holds."""
    return lambda fn: fn() if bool(pred) else None


def loop(lo, hi):
    """`pl.loop`, eagerly: the decorated body runs for each index of `[lo, hi)`."""
    def run(body):
        for i in range(int(lo), int(hi)):
            body(i)
    return run
