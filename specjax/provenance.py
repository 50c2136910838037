"""Where a result came from: the command, the code version, the packages, the machine and how
busy it was. Every benchmark that writes a result JSON stores ``provenance(...)`` in it.

    from specjax.provenance import provenance
    json.dump({**results, "provenance": provenance()}, f)

The machine probing (usable CPUs, busy CPU seconds from /proc/stat, the foreign CPU share over a
window) lives here; specjax/timing.py (Timer) uses the same helpers.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from importlib import import_module

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Packages whose version is recorded when they are importable; torch and transformers only when
# the process has imported them already (importing torch costs seconds and is not provenance).
_ALWAYS = ("jax", "jaxlib", "numpy")
_IF_IMPORTED = ("torch", "transformers", "gguf")


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def busy_cpu_s() -> float | None:
    """Busy CPU seconds (everything but idle/iowait) summed over the usable CPUs, or None where
    /proc/stat is unreadable."""
    want = {f"cpu{c}" for c in usable_cpus()}
    total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in want:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, parts[1:9])
                    total += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    return total / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used, or 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def foreign_cpu_share(window_s: float = 0.5) -> float | None:
    """Share (0..1) of the usable CPUs that *other* processes kept busy during a ``window_s``
    sleep of this one (this process's own CPU time is subtracted), or None without /proc/stat."""
    if not isinstance(window_s, (int, float)) or window_s <= 0:
        raise ValueError(f"window_s must be a positive number, got {window_s!r}")
    b0, c0, t0 = busy_cpu_s(), time.process_time(), time.perf_counter()
    time.sleep(window_s)
    b1, own, wall = busy_cpu_s(), time.process_time() - c0, time.perf_counter() - t0
    if b0 is None or b1 is None or wall <= 0:
        return None
    return min(1.0, max(0.0, (b1 - b0) - own) / (wall * len(usable_cpus())))


def machine(window_s: float = 0.5) -> dict:
    """CPU model and count, usable CPUs, platform, jax devices, load average and the foreign CPU
    share over ``window_s`` seconds (0: not measured)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    out = {"cpu_model": cpu, "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(),
           "platform": platform.platform(), "loadavg": load}
    if "jax" in sys.modules:  # the devices only where jax is in use already (no backend start-up)
        out["jax_backend"] = jax.default_backend()
        out["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    if window_s:
        out["foreign_cpu_window_s"] = window_s
        out["foreign_cpu_share"] = foreign_cpu_share(window_s)
    return out


def versions() -> dict:
    """python, jax, jaxlib, numpy (when importable) and torch / transformers / gguf when this
    process has imported them."""
    out = {"python": platform.python_version()}
    for name in _ALWAYS + tuple(n for n in _IF_IMPORTED if n in sys.modules):
        try:
            out[name] = getattr(import_module(name), "__version__", "?")
        except ImportError:
            out[name] = None
    return out


def git(repo: str = REPO) -> dict:
    """{"commit", "dirty"} of the checkout ``repo`` (None values outside a git checkout)."""
    def run(*args):
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
    try:
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def provenance(command: str | None = None, *, window_s: float = 0.5) -> dict:
    """The record stored beside a result: command (``sys.argv`` joined when None), git commit and
    dirty flag, date (UTC, ISO 8601), package versions, machine and foreign CPU load."""
    if command is not None and not isinstance(command, str):
        raise TypeError(f"command must be a str or None, got {type(command).__name__}")
    return {"command": " ".join(sys.argv) if command is None else command, **git(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": versions(), "machine": machine(window_s)}


def with_provenance(result: dict, command: str | None = None, **kw) -> dict:
    """``result`` (a dict) with a ``"provenance"`` entry added (a new dict; ``result`` is kept)."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be a dict, got {type(result).__name__}")
    return {**result, "provenance": provenance(command, **kw)}
