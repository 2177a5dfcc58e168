import json

import pytest

from fleet.experiment.tables import (
    plot_success_per_round,
    success_table,
    table_markdown,
    wilson_interval,
    write_table,
)


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


def test_paired_differences_match_trials_and_count_discordant_pairs(tmp_path):
    from fleet.experiment.tables import paired_differences, paired_markdown, write_paired

    def eps(successes, task="a"):
        return [{"task": task, "unit_id": 100 + i % 2, "seed": i, "success": s} for i, s in enumerate(successes)]

    base = eps([0] * 20 + [1] * 20) + eps([1] * 10, "b")
    better = eps([1] * 15 + [0] * 5 + [1] * 20) + eps([1] * 10, "b")   # task a: 15 wins, 0 losses
    shuffled = list(reversed(better))                                   # matching is by trial, not by order
    p = paired_differences({"base": base, "fert": shuffled, "same": base}, [("fert", "base"), ("same", "base"),
                                                                           ("missing", "base")], n_boot=2000)
    assert [r["arm"] for r in p["pairs"]] == ["fert", "same"] and p["tasks"] == ["a", "b"]
    a = p["pairs"][0]["tasks"]["a"]
    assert (a["pairs"], a["wins"], a["losses"]) == (40, 15, 0) and a["diff"] == pytest.approx(15 / 40)
    assert a["p_mcnemar"] == pytest.approx(2 * 0.5 ** 15) and 0.2 < a["ci95"][0] < a["diff"] < a["ci95"][1] < 0.55
    avg = p["pairs"][0]["average"]
    assert avg["pairs"] == 50 and avg["diff"] == pytest.approx(15 / 50) and avg["ci95"][0] > 0
    same = p["pairs"][1]["average"]
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and same["p_mcnemar"] == 1.0
    md = paired_markdown(p)
    assert "| fert − base |" in md and "+37.5 [" in md and "(15/0," in md
    assert write_paired(p, tmp_path)[1].is_file()
    with pytest.raises(ValueError, match="two episodes of task a"):
        paired_differences({"x": eps([1, 1]) * 2, "base": base}, [("x", "base")])


def test_ablate_pool_bootstraps_over_the_pooled_runs(tmp_path):
    """scripts/ablate.py ablate.pool: each <dir>/seed_<s>/episodes/<arm>.json is one bootstrap unit; the
    pooled difference is the mean over all matched trials; arms missing from a directory are left out."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.ablate import pool

    def eps(succ):
        return [{"task": "reach-v3", "unit_id": 100, "seed": i, "success": bool(s)} for i, s in enumerate(succ)]

    runs = {"a": ([0, 0, 1, 1], [1, 1, 1, 1]), "b": ([0, 1, 0, 1], [0, 1, 1, 1])}
    for name, (base, fert) in runs.items():
        d = tmp_path / name / "seed_0" / "episodes"
        d.mkdir(parents=True)
        (d / "base.json").write_text(json.dumps(eps(base)))
        (d / "fert.json").write_text(json.dumps(eps(fert)))
    (tmp_path / "a" / "seed_0" / "episodes" / "filtered_bc.json").write_text(json.dumps(eps([0, 0, 0, 0])))
    pool([tmp_path / "a", tmp_path / "b"], tmp_path / "out", "base")
    paired = json.loads((tmp_path / "out" / "ablate_paired.json").read_text())
    [p] = paired["pairs"]                                    # filtered_bc ran in one directory only
    assert (p["arm"], p["baseline"]) == ("fert", "base")
    assert p["average"]["diff"] == pytest.approx(3 / 8) and p["average"]["wins"] == 3 and p["average"]["losses"] == 0
    assert p["per_seed"] == {"0": 0.5, "1": 0.25} or p["per_seed"] == {0: 0.5, 1: 0.25}
    assert len(paired["units"]) == 2
    with pytest.raises(SystemExit, match="no evaluated arms"):
        pool([tmp_path / "nothing"], tmp_path / "o2", "base")


def test_stdout_goes_to_the_run_log_too(tmp_path, capsys):
    """fleet.progress.tee_stdout_to_log (issue 52, item 11): printed lines reach the root logger's log file as well
    as stdout, whole lines beside the log records; nothing after the context."""
    import logging

    from fleet.progress import tee_stdout_to_log

    root = logging.getLogger()
    fh = logging.FileHandler(tmp_path / "run.log")
    root.addHandler(fh)
    try:
        with tee_stdout_to_log():
            print("=== [stage 1/3] demos ===")
            logging.getLogger("x").warning("a record")
            print("learning curve", end="")
        print("after")
    finally:
        root.removeHandler(fh)
        fh.close()
    log = (tmp_path / "run.log").read_text().splitlines()
    assert log == ["=== [stage 1/3] demos ===", "a record", "learning curve"]
    assert capsys.readouterr().out == "=== [stage 1/3] demos ===\nlearning curveafter\n"


def test_rounds_panel_counts_versions_and_fits_its_y_axis(tmp_path, monkeypatch):
    """plot_arms' third panel: x is the policy version (as the printed curve), the y axis fitted to the rates (a
    71-100 % curve is not squashed into 0-100)."""
    import fleet.experiment.tables as tables

    seen = {}
    monkeypatch.setattr(tables, "_save", lambda fig, path: seen.update(fig=fig) or path)
    rows = {"base": [{"task": "reach-v3", "unit_id": 100, "seed": s, "success": s % 3 > 0} for s in range(9)]}
    rounds = {"held-out K=1": [{"round": v, "successes": k, "trials": 100} for v, k in ((1, 71), (2, 85), (3, 92))]}
    tables.plot_arms(tables.success_table(rows), tmp_path / "a.png", rounds=rounds)
    ax = seen["fig"].axes[2]
    lo, hi = ax.get_ylim()
    assert 0.5 < lo < 0.71 and 0.92 < hi <= 1.02 and "version" in ax.get_xlabel()
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3]
