"""One launch configuration: ``pv.launch``, ``pv.export_torchrun``, the CLI and the Explorer share ``LaunchConfig``
(one set of defaults, one validation, one payload builder)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.schedule.config import UNSET, launch_config
from pipeviz.zoo import MyNetwork


@pytest.fixture(scope="module")
def small() -> tuple[pv.SplitPlan, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, x, y = MyNetwork(8, [8, 8, 8]), torch.randn(8, 8), torch.randint(0, 10, (8,))
    return pv.trace(model, example_args=(x,)).split(["layer0"]), x, y


def test_the_front_doors_take_the_config_and_its_fields_with_one_set_of_defaults() -> None:
    # the configuration is the second parameter (the third, after the path, of the export), whole, as pv.simulate
    # takes it; its fields come as keywords; no option dict restates them
    for door, position in ((pv.launch, 1), (pv.export_torchrun, 2)):
        params = inspect.signature(door).parameters
        assert list(params).index("config") == position
        assert params["config"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert all(params[n].default is UNSET for n in ("microbatches", "steps"))  # the config's
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values()) <= 3
    assert list(inspect.signature(pv.simulate).parameters)[:2] == ["plan", "config"]
    explorer_params = inspect.signature(pv.Explorer.__init__).parameters
    assert all(explorer_params[n].default is UNSET for n in ("schedule", "microbatches", "steps", "devices"))
    cfg = pv.LaunchConfig()
    assert (cfg.schedule, cfg.microbatches, cfg.steps, cfg.timeout, cfg.dp, cfg.tp) == ("1F1B", 4, 1, 120.0, 1, 1)


def test_options_override_the_config_and_unknown_ones_are_named() -> None:
    base = pv.LaunchConfig(schedule="GPipe", microbatches=8, dp=2)
    merged = launch_config(base, schedule=UNSET, microbatches=4, steps=None, timeout=30.0)
    assert (merged.schedule, merged.microbatches, merged.steps) == ("GPipe", 4, None)
    assert (merged.timeout, merged.dp) == (30.0, 2)
    assert base.microbatches == 8  # frozen: replace returns a copy
    with pytest.raises(TypeError, match=r"Unknown launch option 'micro_batches'; valid: schedule, microbatches, "):
        base.replace(micro_batches=4)
    with pytest.raises(TypeError, match=r"config must be a pv\.LaunchConfig or a schedule's name, got dict"):
        launch_config({"schedule": "GPipe"})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.dp = 4  # type: ignore[misc]


def test_launch_and_export_validate_the_same_config(small: tuple[pv.SplitPlan, torch.Tensor, torch.Tensor],
                                                     tmp_path: Path) -> None:
    plan, x, y = small
    bad = pv.LaunchConfig(microbatches=4, loss_fn=F.cross_entropy, on_nonfinite="ignore")
    for door in (lambda: pv.launch(plan, config=bad, inputs=(x,), target=y),
                 lambda: pv.export_torchrun(plan, tmp_path / "bad.py", config=bad, inputs=(x,), target=y)):
        with pytest.raises(pv.LaunchError, match=r"on_nonfinite='ignore'; valid: 'stop', 'continue'"):
            door()
    assert not (tmp_path / "bad.py").exists()
    with pytest.raises(pv.LaunchError, match=r"devices='cpu' cannot be exported: under torchrun"):
        pv.export_torchrun(plan, tmp_path / "cpu.py", inputs=(x,), target=y, loss_fn=F.cross_entropy, devices="cpu")
    with pytest.raises(TypeError, match=r"Unknown launch option 'lr'"):
        pv.launch(plan, inputs=(x,), target=y, lr=0.1)  # type: ignore[call-arg]


def test_an_exported_rank_gets_the_payload_launch_would_build(
        small: tuple[pv.SplitPlan, torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    from pipeviz.runtime.payloads import rank_payload

    plan, x, y = small
    cfg = pv.LaunchConfig(schedule="GPipe", microbatches=2, steps=5, loss_fn=F.cross_entropy, dp=2, timeout=45.0)
    script = pv.export_torchrun(plan, tmp_path / "t.py", config=cfg, steps=7, inputs=(x,), target=y)
    job = cloudpickle.loads(script.with_suffix(".payload.pkl").read_bytes())
    spec = job["spec"]
    assert spec.config == cfg.replace(steps=7) and spec.steps == 7 and spec.mesh == pv.Mesh(pp=2, dp=2)
    # rank 3 = pipeline rank 1, replica 1: the last stage, with the second half of the target
    payload = rank_payload(spec, job["stages"], job["tied"], 3, timeout=spec.config.timeout)
    assert [s.index for s in payload.stages] == [1] and payload.args == () and payload.timeout_s == 45.0
    assert torch.equal(payload.target, y[4:]) and payload.mesh == spec.mesh and payload.world == 4
    first = rank_payload(spec, job["stages"], job["tied"], 1)  # pipeline rank 0, replica 1: the inputs' half
    assert torch.equal(first.args[0], x[4:]) and first.target is None
