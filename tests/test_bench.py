"""bench.py without a GPU: points at the recorded results and exits non-zero (no traceback);
--merge and --readme-table work anywhere, and README's table is the recorded one."""

import os
import subprocess
import sys

from conftest import ROOT


def test_bench_without_gpu_points_at_the_results():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for args in ([], ["--sweep", "--backward"]):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "no CUDA GPU visible" in proc.stderr and "results/h200_sweep.json" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_bench_without_gpu_names_each_modes_results():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for args, recorded in ((["--mining"], "results/h200_mining.json"),
                           (["--loops"], "results/h200_loops.json")):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and recorded in proc.stderr, proc.stderr


def test_readme_table_is_the_recorded_one():
    """README's speed tables are generated from results/ (python bench.py --readme-table)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--readme-table"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for table in proc.stdout.strip().split("\n\n"):
        # the triplet tables at the KernelBench shape, the mining, drop-in and CPU tables
        assert table.count("\n") >= 3 and ("32768 x 8192" in table or "| mining |" in table
                                            or "| drop-in |" in table
                                            or "| loss on CPU |" in table)
        assert table in readme, "README's tables differ: paste `python bench.py --readme-table`"


def test_cpu_mode_times_each_case_against_its_library():
    """--cpu's cases run on CPU: ours and each library's step (or the line why it is skipped)."""
    sys.path.insert(0, ROOT)
    import bench

    for family, variant in bench.CPU_CASES:
        rows = bench.bench_cpu(family, variant, 16, 8, rounds=1, warmup=0)
        assert all("step_ms" in r or "skipped" in r for r in rows), rows
        assert any(r["contender"] == "fused_triplet" and r["step_ms"] > 0 for r in rows) or \
            rows[0].get("skipped"), rows


def test_merge_joins_parts_without_a_gpu(tmp_path):
    """--merge joins sweep parts written by --json: tables, a markdown table and one JSON."""
    import json

    def row(contender, ms, speedup):
        return {"shape": [4, 8], "dtype": "float32", "mode": "forward", "contender": contender,
                "median_ms": ms, "min_ms": ms, "tbps": 1.0, "peak_pct": 20.0,
                "max_abs_err_vs_eager": 0.0, "fused_speedup": speedup}

    parts = []
    for k, shape in enumerate(([4, 8], [2, 16])):
        rows = [row("eager", 3.0, 3.0), row("torch.compile", 1.5, 1.5),
                row("fused_triplet", 1.0, 1.0)]
        for r in rows:
            r["shape"] = shape
        parts.append(tmp_path / f"part{k}.json")
        parts[-1].write_text(json.dumps({"meta": {"gpu": "test"}, "results": rows}))
    out = tmp_path / "merged.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--merge",
                           *map(str, parts), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = "| forward | 4x8 | float32 | 3.0000 | 1.5000 | 1.0000 | 1.00 | 3.00x | 1.50x |"
    assert line in proc.stdout
    assert "| forward | 2x16 |" in proc.stdout
    merged = json.loads(out.read_text())
    assert len(merged["results"]) == 6 and len(merged["meta"]["parts"]) == 2
