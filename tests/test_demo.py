"""The embedded default really learns: a shortened, seeded `trl-qerl demo` raises held-out accuracy."""

import csv
import importlib.util
import json

import pytest

from trl_qerl.demo import DEMO_DEFAULTS, main, run_demo


@pytest.mark.slow
def test_shortened_demo_raises_held_out_accuracy(tmp_path):
    # 20 of the demo's 60 steps: measured 0.53 -> 0.68 (seed 0) and 0.53 -> 0.70 (seed 1) on 100 problems.
    summary = run_demo(tmp_path, steps=20, eval_problems=100, seed=0, verbose=False)

    assert summary["accuracy_before"] < 0.6, "the shipped model should leave room for RL"
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.08
    with open(tmp_path / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 20
    assert {"reward", "entropy", "sigma"} <= set(rows[0])
    sigmas = [float(row["sigma"]) for row in rows]
    assert sigmas[0] == 0.0 and max(sigmas) > 0.0, "AQN: stage 0 is noise-free, later stages add noise"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "metrics.png").stat().st_size > 0
    else:
        assert summary["plot"] is None
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["accuracy_after"] == summary["accuracy_after"]


def test_demo_defaults_are_the_documented_ones():
    assert DEMO_DEFAULTS["steps"] * DEMO_DEFAULTS["batch"] >= 1000
    assert DEMO_DEFAULTS["batch"] % DEMO_DEFAULTS["generations"] == 0


def test_demo_cli_rejects_bad_steps(capsys):
    with pytest.raises(SystemExit):
        main(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err
