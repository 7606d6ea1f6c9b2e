"""The checked-in sbatch scripts in slurm/ are what the template renders now."""

from __future__ import annotations

import subprocess
from pathlib import Path

from megatron_rl.launch.render import CHECKED_IN, render_checked_in
from megatron_rl.launch.render import main as render_main

ROOT = Path(__file__).resolve().parents[3]


def test_checked_in_scripts_equal_what_the_template_renders_now():
    for recipe, script in CHECKED_IN.items():
        text = (ROOT / script).read_text()
        assert text == render_checked_in(recipe), (
            f"{script} is stale: run python -m megatron_rl.launch.render --write"
        )
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert render_main(["--check"]) == 0


def test_check_reports_a_stale_script(tmp_path, monkeypatch, capsys):
    import megatron_rl.launch.render as render

    stale = tmp_path / "slurm" / "scalerl_8b.sbatch"
    stale.parent.mkdir()
    stale.write_text("#!/bin/bash\n# edited by hand\n")
    monkeypatch.setattr(render, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(render, "render_checked_in", lambda recipe: "rendered\n")
    monkeypatch.setattr(
        render, "CHECKED_IN", {"recipes/scalerl_8b.yaml": "slurm/scalerl_8b.sbatch"}
    )
    assert render_main(["--check"]) == 1
    assert "slurm/scalerl_8b.sbatch" in capsys.readouterr().err
    assert render_main(["--write"]) == 0 and stale.read_text() == "rendered\n"
