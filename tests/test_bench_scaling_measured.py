"""bench scaling_measured's rows, summary and verdict (the measurement itself runs on a host with 8+ cores)."""

from __future__ import annotations

from taskrt.bench import pages, scaling_measured


def row(devices, strategy, ms, simulated_ms):
    return {"model": "alexnet32", "devices": devices, "strategy": strategy, "measured_ms": ms,
            "simulated_ms": simulated_ms, "simulated_error": (simulated_ms - ms) / ms}


def test_speedups_summary_and_verdict():
    rows = scaling_measured.with_speedups([
        row(1, "single device", 800, 820), row(2, "data", 500, 480), row(2, "owt", 450, 470),
        row(2, "searched", 440, 430), row(4, "data", 300, 280), row(4, "owt", 260, 250), row(4, "searched", 320, 240)])
    assert rows[3]["speedup"] == 800 / 440 and rows[3]["simulated_speedup"] == 820 / 430
    lines = scaling_measured.summary_lines(rows, [8], 4)
    assert "2: data 1.60x (simulated 1.71x), owt 1.78x (simulated 1.74x), searched 1.82x (simulated 1.91x)" in lines[1]
    assert lines[2] == "alexnet32: the searched strategy measured slower than another at 4 devices (0.81x of the best)"
    assert "not run: 8 devices" in lines[-1]
    verdict = pages.scaling_measured_verdict({"rows": rows, "cores": 4})
    assert verdict.startswith("NOT met: measured on 2, 4 devices of 4 cores (not run: 8)")
    assert "slower than another on alexnet32 on 4 (0.81x of the best)" in verdict
    fine = [r for r in rows if r["devices"] < 4] + [row(4, "data", 300, 1), row(4, "owt", 260, 1),
                                                     row(4, "searched", 270, 1), row(8, "data", 200, 1),
                                                     row(8, "owt", 190, 1), row(8, "searched", 180, 1)]
    assert pages.scaling_measured_verdict({"rows": fine, "cores": 16}).startswith("met: measured on 2, 4, 8 devices")
