"""titan_uniep.tools.memory_flat on synthetic loss files (the GPU runs write real ones)."""

import json

import pytest

from titan_uniep.tools.memory_flat import main, spread

MIB = 2**20


def write_run(tmp_path, name, allocated, peak):
    run = tmp_path / name
    run.mkdir()
    lines = [{"step": i + 1, "loss": 5.0 - 0.01 * i, "mem_allocated": a, "mem_peak": p}
             for i, (a, p) in enumerate(zip(allocated, peak))]
    (run / "loss.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def test_flat_run_passes_and_warm_up_is_skipped(tmp_path, capsys):
    # Steps 1-5 grow (optimizer states, workspaces); afterwards constant.
    allocated = [100 * MIB, 300 * MIB, 400 * MIB, 410 * MIB, 410 * MIB] + [410 * MIB] * 95
    peak = [200 * MIB, 600 * MIB, 700 * MIB, 700 * MIB, 700 * MIB] + [700 * MIB] * 95
    run = write_run(tmp_path, "flat", allocated, peak)
    assert main([str(run)]) == 0
    assert "FLAT" in capsys.readouterr().out
    assert spread(run, 5)["mem_allocated"] == (410 * MIB, 410 * MIB, 410 * MIB)


def test_leak_is_reported(tmp_path, capsys):
    allocated = [400 * MIB + i * MIB // 2 for i in range(100)]  # half a MiB per step
    peak = [700 * MIB] * 100
    run = write_run(tmp_path, "leak", allocated, peak)
    assert main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "NOT FLAT" in out and "growth 47.00 MiB" in out
    assert main([str(run), "--tolerance-mib", "64"]) == 0


def test_cpu_run_without_memory_figures_is_an_error(tmp_path):
    run = tmp_path / "cpu"
    run.mkdir()
    (run / "loss.jsonl").write_text(json.dumps({"step": 9, "loss": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="no memory figures"):
        main([str(run)])
