"""scripts/bench_all.py stays in step with the benchmarks it runs (running them is not a test)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import bench_all  # noqa: E402


@pytest.mark.parametrize("bench", bench_all.BENCHES, ids=lambda b: b.name)
def test_every_flag_bench_all_passes_is_one_its_script_takes(bench):
    for args in (bench.args, bench.quick):
        script, *flags = args
        done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        for flag in (f for f in flags if f.startswith("--")):
            assert flag in done.stdout, f"{script} takes no {flag}"


def test_an_unknown_benchmark_is_refused_with_the_names_to_choose_from():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_all.py"), "--only", "speed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown benchmark(s) ['speed']: choose from recovery, hang" in done.stderr
