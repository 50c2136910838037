"""Fair timing on a shared machine: interleaved rounds after a warm-up, the CPU share other
processes used during each timed run ("foreign CPU"), medians with their spread.

Used by the CLI's demo, specjax.train.pipeline's speedup scoring and the benchmark scripts.
"""

from __future__ import annotations

import statistics
import time

from specjax.provenance import busy_cpu_s, machine, process_cpu_s, usable_cpus  # noqa: F401

# ------------------------------------------------------------------------------ the machine


# The machine probing lives in specjax/provenance.py (shared with every result's provenance).
_busy_s = busy_cpu_s
_process_cpu_s = process_cpu_s


class Timer:
    """Wall time of a block, and the share of the usable CPUs other processes used meanwhile.

    ``own_pids``: processes that belong to the measurement (e.g. a server the benchmark started);
    their CPU time counts as ours, not as foreign load."""

    def __init__(self, own_pids=()):
        self.own_pids = tuple(own_pids)

    def _own_s(self) -> float:
        return time.process_time() + sum(_process_cpu_s(p) for p in self.own_pids)

    def __enter__(self):
        self.b0, self.c0, self.t0 = _busy_s(), self._own_s(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        own = self._own_s() - self.c0
        b1 = _busy_s()
        self.foreign = None
        if self.b0 is not None and b1 is not None and self.wall > 0:
            self.foreign = min(1.0, max(0.0, (b1 - self.b0) - own) / (self.wall * len(usable_cpus())))
        return False


def wait_idle(timeout_s: float, threshold: float = 0.05, quiet_s: float = 3.0) -> float:
    """Waits (up to timeout_s) until other processes use < threshold of the CPUs for quiet_s."""
    start, quiet = time.perf_counter(), 0.0
    while timeout_s > 0 and time.perf_counter() - start < timeout_s:
        with Timer() as t:
            time.sleep(1.0)
        quiet = quiet + t.wall if (t.foreign is not None and t.foreign < threshold) else 0.0
        if quiet >= quiet_s:
            break
    return time.perf_counter() - start


def interleaved_rounds(runs: dict, rounds: int = 3, wait_idle_s: float = 0.0) -> dict:
    """Times compared runs fairly: one untimed warm-up call each (compilation), then ``rounds``
    rounds, each calling every run once, in alternating order (forward, reversed, ...), so load
    drift hits all runs alike.

    Args:
      runs: {name: zero-argument callable}; its last return value is kept.
      rounds: timed rounds (>= 3 for a median with a spread).
    Returns:
      {name: {"wall_s": [rounds], "foreign_cpu": [rounds] (share of the CPUs other processes
      used during the call, None where unknown), "result": the last return value}}.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(runs)
    out = {n: {"wall_s": [], "foreign_cpu": [], "result": runs[n]()} for n in names}  # warm-up
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            wait_idle(wait_idle_s)
            with Timer() as t:
                out[n]["result"] = runs[n]()
            out[n]["wall_s"].append(t.wall)
            out[n]["foreign_cpu"].append(t.foreign)
    return out


def add_timing_args(parser) -> None:
    """The ``--rounds`` / ``--wait-idle`` options every interleaved benchmark script takes."""
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds after the warm-up (>= 3 for a meaningful spread)")
    parser.add_argument("--wait-idle", type=float, default=0.0,
                        help="wait up to this many seconds for a quiet machine before each timed run")


def check_timing_args(parser, args) -> None:
    """Rejects ``--rounds`` < 1 through ``parser.error`` (exit 2, the option named)."""
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (timed rounds after the warm-up), got {args.rounds}")


def spread(values) -> dict:
    """Median, min and max of per-round values (a speedup's spread is its per-round ratios')."""
    v = sorted(float(x) for x in values)
    return {"median": float(statistics.median(v)), "min": v[0], "max": v[-1], "rounds": len(v)}


def paired_speedup(base_wall: list, wall: list) -> dict:
    """Per-round speedups base / run (rounds are interleaved, so each pair saw similar load)."""
    return spread([b / w for b, w in zip(base_wall, wall)])


def max_foreign(*results) -> float | None:
    """Largest foreign CPU share seen by any of the given interleaved_rounds results."""
    fc = [f for r in results for f in r["foreign_cpu"] if f is not None]
    return max(fc) if fc else None


def machine_info() -> dict:
    """CPU model and count, usable CPUs, platform, devices and load average (no sampling)."""
    return machine(window_s=0)
