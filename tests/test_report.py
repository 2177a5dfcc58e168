import json

import pytest

from fleet.report import plot_success_per_round, success_table, table_markdown, wilson_interval, write_table


def test_wilson_interval_known_values():
    # Reference values from the closed form (Brown, Cai & DasGupta 2001, Table 1 style check):
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson_interval(0, 50)[0] == pytest.approx(0.0, abs=1e-12) and wilson_interval(0, 50)[1] == pytest.approx(0.0714, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes <= trials"):
        wilson_interval(3, 2)


def test_success_table_and_files(tmp_path):
    results = {
        "base": [{"task": "a", "success": i < 3} for i in range(10)] + [{"task": "b", "success": False}] * 10,
        "fert": [{"task": "a", "success": True}] * 10 + [{"task": "b", "success": i < 5} for i in range(10)],
    }
    table = success_table(results)
    assert table["tasks"] == ["a", "b"]
    assert table["arms"]["base"]["average"]["successes"] == 3
    assert table["arms"]["fert"]["tasks"]["b"]["rate"] == 0.5
    md = table_markdown(table)
    assert "| fert |" in md and "100.0%" in md
    md_path, js_path = write_table(table, tmp_path)
    assert json.loads(js_path.read_text())["arms"]["base"]["average"]["trials"] == 20
    png = plot_success_per_round({"fert": [{"round": 0, "successes": 3, "trials": 10},
                                           {"round": 1, "successes": 7, "trials": 10}]}, tmp_path / "p.png")
    assert png.stat().st_size > 1000
