"""How long ``pv.TimelineView`` takes to redraw a long run in Python (what the kernel spends per live redraw),
by event count, side by side. The browser's own drawing time is not included.

    python benchmarks/speed/timeline_redraw.py
"""

from __future__ import annotations

import statistics
import time

import pipeviz as pv
from pipeviz.schedule.timeline import Event, Timeline


def synthetic(n: int, ranks: int = 4, microbatches: int = 8) -> list[Event]:
    events: list[Event] = []
    step = 0
    while len(events) < n:
        for r in range(ranks):
            for m in range(microbatches):
                for k, kind in enumerate(("F", "B")):
                    t = step + 0.01 * (r + 2 * m + k)
                    events.append(Event(r, r, kind, m, t, t + 0.008, step))
        step += 1
    return events[:n]


def main() -> None:
    print(f"{'events':>8}{'redraw (median of 5)':>24}")
    for n in (100, 1_000, 3_000, 10_000, 30_000):
        tl = Timeline(synthetic(n), 4, 4, 8, "1F1B")
        view = pv.TimelineView(tl)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            view.update(tl)
            times.append(time.perf_counter() - t0)
        print(f"{n:>8,}{statistics.median(times) * 1e3:>21.1f} ms")


if __name__ == "__main__":
    main()
