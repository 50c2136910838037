"""benchmarks/gpu_kernels.py (the prepared H200 kernel benchmark) runs end to end in its CPU
smoke mode (tiny shapes, Pallas interpreter): every section fills its rows, the kernels agree
with the references, and the JSON lands in the output folder — so the GPU script cannot rot."""

import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_kernels_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "gpu_kernels_smoke", os.path.join(REPO, "benchmarks", "gpu_kernels.py"))
    mod = importlib.util.module_from_spec(spec)  # loaded as benchmarks/gpu_check.py loads it
    spec.loader.exec_module(mod)
    res = mod.main(str(tmp_path), quick=True, cpu_smoke=True, budget_s=600)
    assert res["all_correct"] and res["env"]["mode"] == "cpu-smoke"
    for name in ("correctness", "decode", "tree", "prefill", "tuning_decode", "tuning_prefill"):
        assert res[name], name
        for row in res[name]:
            assert "error" not in row and "skipped" not in row, (name, row)
    assert all(r["us"] > 0 for r in res["decode"] + res["prefill"])
    assert all(r["tree_us"] > 0 and r["verify_same_kernel_us"] > 0 for r in res["tree"])
    saved = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert saved["all_correct"] and (tmp_path / "gpu_kernels.txt").exists()
    assert "tree_over_best_verify_pct" in capsys.readouterr().out
