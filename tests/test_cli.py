"""`pipeviz demo`: the headless main job writes a report and checks numerics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_writes_a_self_contained_report(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeviz.cli", "demo", "--model", "classic", "--steps", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numerics: the run matches the unsplit model" in proc.stdout
    assert f"report: {out.resolve()}" in proc.stdout
    ranks = int(re.search(r"on (\d+) processes", proc.stdout).group(1))  # type: ignore[union-attr]
    cores = len(os.sched_getaffinity(0))
    assert (f"{ranks} processes shared {cores} CPU cores" in proc.stdout) == (ranks > cores)
    html = out.read_text()
    assert "Plotly" in html and "<script src=" not in html  # plotly.js is embedded: opens offline
    assert "Measured run (simulation overlaid)" in html and "Schedules compared" in html
    # the graph, the measured run, the schedules compared and why the simulated step takes what it takes
    assert html.count('class="plotly-graph-div"') == 4 and "Why the simulated step takes what it takes" in html
    # Every schedule on the same ranks; beside the local run, the model planned for a named cluster.
    assert "every one on 3 ranks" in proc.stdout and "needs 6 stages (2 per rank)" in proc.stdout
    assert "planned for 8 x h100-sxm" in proc.stdout
    assert "Planned for a cluster: 8 x h100-sxm" in html and "<th>MFU</th>" in html


@pytest.mark.compat  # make compat: the families train in make test already (tests/test_families.py)
@pytest.mark.parametrize("model", ["llama", "moe"])
def test_demo_trains_the_seed_families(model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from pipeviz.cli import main

    out = tmp_path / "r.html"
    assert main(["demo", "--model", model, "--stages", "2", "--steps", "2", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert {"llama": "LLaMA", "moe": "Mixture of experts"}[model] in text
    assert "numerics: the run matches the unsplit model" in text and "DualPipeV" in text
    assert out.read_text().count('class="plotly-graph-div"') == 4  # graph, measured run, schedules compared, why


def test_demo_bad_option_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeviz.cli", "demo", "--model", "classic", "--schedule", "gpipee",
         "--output", str(tmp_path / "r.html")], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "pipeviz: Unknown schedule 'gpipee'. Did you mean 'GPipe'?" in proc.stderr


@pytest.mark.compat  # make compat (CI): keeps make test within 10 minutes (the demo's report is tested above)
def test_demo_trains_as_large_runs_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Accumulation, a warm-up-cosine schedule, clipping, bf16, compiled stages and a held-out batch from the CLI:
    the run still matches the unsplit model trained the same way (held-out losses included)."""
    from pipeviz.cli import main

    out = tmp_path / "r.html"
    assert main(["demo", "--model", "classic", "--steps", "2", "--accumulate", "2", "--lr-warmup", "1",
                 "--eval-every", "1", "--clip-grad-norm", "0.5", "--mixed-precision", "bf16", "--compile", "aot_eager",
                 "--cluster-gpus", "0", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "learning rates: 0.05, 0.05" in text and "held-out losses: step 0: " in text and "step 1: " in text
    assert "numerics: the run matches the unsplit model" in text


def test_demo_recomputes_activations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--recompute full``: each layer runs again in its backward and the run still matches the unsplit model; the
    report puts each process's planned peak of saved activations beside the measured one (within 10 %)."""
    import re

    from pipeviz.cli import main

    assert main(["demo", "--model", "classic", "--steps", "1", "--recompute", "full", "--cluster-gpus", "0",
                 "--output", str(tmp_path / "r.html")]) == 0
    assert "numerics: the run matches the unsplit model" in capsys.readouterr().out
    page = (tmp_path / "r.html").read_text()
    assert "Peak saved activations per process, planned" in page
    assert "Why the simulated step takes what it takes" in page and "critical path" in page
    errors = [float(e) for e in re.findall(r"<td>([+-][0-9.]+)%</td></tr>", page)]
    assert errors and all(abs(e) <= 10 for e in errors), errors


def test_plan_searches_the_cp_degrees_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pipeviz plan --cp 2``: every row splits each sequence in two (a cp column); ``--cp 0`` is refused naming cp,
    the value and the fix."""
    import json

    transformers = pytest.importorskip("transformers")
    from pipeviz.cli import main

    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                                   architectures=["LlamaForCausalLM"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    args = ["plan", "--config", str(path), "--gpus", "8", "--global-batch", "32", "--top", "3", "--no-synthesize"]
    assert main([*args, "--cp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    assert lines[header].split()[:5] == ["#", "pp", "dp", "cp", "tp"]
    assert [line.split()[3] for line in lines[header + 1:header + 4]] == ["2", "2", "2"]
    assert main([*args, "--cp", "0"]) == 2
    assert "pipeviz: cp must be a positive int" in capsys.readouterr().err
