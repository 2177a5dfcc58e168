"""The ``fleetmind`` command's help (issue 52, item 10): a short usage per command, fast, no model imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleet.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]


def test_each_command_has_a_short_usage_with_its_examples_and_groups(capsys):
    for cmd in COMMANDS:
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[0].startswith(f"usage: fleetmind {cmd} ") and len(lines) < 40, (cmd, len(lines))
        assert "examples:" in out and f"fleetmind {cmd} " in lines[3], cmd      # from its script's own docstring
        assert "task " in out and "mw_mid" in out and "--cfg job" in out
    main(["eval", "-h"])
    assert "eval.checkpoints" in capsys.readouterr().out                        # the key the command needs


def test_help_loads_neither_hydra_nor_torch():
    code = ("import sys; from fleet.cli import main; main(['train', '--help']); "
            "assert not {'torch', 'hydra', 'ray'} & set(sys.modules), sorted(set(sys.modules) & {'torch', 'hydra'})")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: fleetmind train")
