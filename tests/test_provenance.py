"""specjax.provenance: the record every benchmark result JSON carries (issue 45 point 6)."""

import datetime
import json
import os
import subprocess
import sys

import pytest

from specjax import provenance as pv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_provenance_fields_match_the_checkout_and_the_process():
    p = pv.provenance("bench x --y 1", window_s=0.2)
    assert p["command"] == "bench x --y 1"
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert p["commit"] == head and len(head) == 40
    assert isinstance(p["dirty"], bool)
    when = datetime.datetime.fromisoformat(p["date"])
    assert when.tzinfo is not None and when.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60
    import jax
    import numpy as np
    v = p["versions"]
    assert v["jax"] == jax.__version__ and v["numpy"] == np.__version__
    assert v["python"] == ".".join(map(str, sys.version_info[:3]))
    m = p["machine"]
    assert m["cpu_count"] == os.cpu_count() and len(m["usable_cpus"]) >= 1
    assert len(m["loadavg"]) == 3 and m["foreign_cpu_window_s"] == 0.2
    assert m["foreign_cpu_share"] is None or 0.0 <= m["foreign_cpu_share"] <= 1.0
    assert m["devices"] and m["jax_backend"] == jax.default_backend()  # jax is imported here
    json.dumps(p)  # JSON-able as is


def test_command_defaults_to_argv_and_bad_input_raises():
    assert pv.provenance(window_s=0.05)["command"] == " ".join(sys.argv)
    with pytest.raises(TypeError, match="command"):
        pv.provenance(["a", "b"])
    with pytest.raises(ValueError, match="window_s"):
        pv.foreign_cpu_share(0)
    with pytest.raises(TypeError, match="result"):
        pv.with_provenance([1, 2])
    r = {"a": 1}
    out = pv.with_provenance(r, "c", window_s=0.05)
    assert out["a"] == 1 and out["provenance"]["command"] == "c" and "provenance" not in r


def test_foreign_share_sees_a_busy_child_process():
    """A child spinning on one CPU is foreign load: the share is at least ~its CPU's share."""
    if pv.busy_cpu_s() is None:
        pytest.skip("no /proc/stat")
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\n"
                              "while time.time() - t < 5: pass"])
    try:
        share = pv.foreign_cpu_share(1.0)
    finally:
        child.kill()
        child.wait()
    # the child has (at most) one CPU of the usable ones; on a crowded host it gets less
    assert share > 0.25 / len(pv.usable_cpus()), share


def test_git_outside_a_checkout(tmp_path):
    assert pv.git(str(tmp_path)) == {"commit": None, "dirty": None}


def test_every_result_writing_benchmark_stamps_provenance():
    """Each benchmarks/*.py that writes a result JSON (json.dump / bench.dump of a result) wraps
    it in with_provenance (gpu_check / gpu_kernels / gpu_corpus put provenance() in their data)."""
    bdir = os.path.join(ROOT, "benchmarks")
    missing = []
    for name in sorted(os.listdir(bdir)):
        if not name.endswith(".py") or name == "weights_transport.py":  # a parts manifest
            continue
        src = open(os.path.join(bdir, name)).read()
        # gpu_corpus.py writes through gpu_check.Report, which stores provenance()
        if ("json.dump" in src or "bench.dump" in src) and "provenance" not in src:
            missing.append(name)
    assert not missing, missing
