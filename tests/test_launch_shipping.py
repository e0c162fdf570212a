"""How a launch reaches its ranks (pipeviz.runtime.ship, payloads.launch_stages): the model's values mapped from one
file instead of pickled, torch's Pipe traced once per plan and input shape, and the values always the model's now."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeviz as pv
from pipeviz.runtime import ship
from pipeviz.zoo import MyNetwork


def test_values_are_mapped_copy_on_write_in_their_dtypes_and_shapes(tmp_path: object) -> None:
    big = torch.randn(256, 128)  # 128 KiB: mapped
    half = torch.randn(128, 512).to(torch.bfloat16)  # 128 KiB: mapped, a dtype numpy lacks
    strided = torch.randn(512, 64).t()  # not contiguous: written contiguous, same values
    small = torch.arange(10)  # inline
    shipment = ship.write_values({"big": big, "half": half, "strided": strided, "small": small},
                                 prefix=f"pipeviz-values-{os.getpid()}-test-")
    try:
        assert shipment.path and set(shipment.slots) == {"big", "half", "strided"} and set(shipment.inline) == {"small"}
        assert shipment.path.startswith(ship.values_folder(shipment.nbytes))
        p = nn.Parameter(big.clone())
        refs = {id(p): (p, ship.Shipped("big", 0, True, True)), id(half): (half, ship.Shipped("half", 1, False, False)),
                id(strided): (strided, ship.Shipped("strided", 2, False, False)),
                id(small): (small, ship.Shipped("small", 3, False, False))}
        # p twice (one tensor under two names stays one object), a plain value beside the tensors
        obj = {"p": p, "again": [p], "half": half, "strided": strided, "small": small, "n": 3}
        data = ship.dumps(obj, refs)
        assert len(data) < 4096  # no value travels in the pickle but the small one
        one, two = ship.loads(data, shipment), ship.loads(data, shipment)
        assert isinstance(one["p"], nn.Parameter) and one["p"].requires_grad and one["again"][0] is one["p"]
        assert one["half"].dtype == torch.bfloat16 and not isinstance(one["half"], nn.Parameter)
        for key, want in (("p", big), ("half", half), ("strided", strided), ("small", small)):
            assert torch.equal(one[key].detach(), want) and one[key].shape == want.shape
        with torch.no_grad():  # a rank's optimizer step: its own pages, never another rank's nor the file's
            one["p"].add_(1.0)
            one["small"].add_(1)
        assert torch.equal(two["p"].detach(), big) and torch.equal(two["small"], small)
        assert torch.equal(ship.loads(data, shipment)["p"].detach(), big)
    finally:
        os.unlink(shipment.path)


@pytest.mark.slow
def test_a_second_launch_traces_nothing_and_ships_the_models_values_as_they_are_now(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeviz.runtime import stages as stages_mod

    built = []
    real = stages_mod.build_stages
    monkeypatch.setattr(stages_mod, "build_stages", lambda *a, **k: built.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = MyNetwork(64, [256, 256, 256])  # layers of 64-256 KiB: mapped from the values file
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    plan = pv.trace(model, example_args=(x,)).split(["layer0", "layer1"])

    def launch() -> pv.Run:
        run = pv.launch(plan, "1F1B", 4, steps=2, inputs=(x,), target=y, loss_fn=F.cross_entropy)
        assert run.wait(120) == "done", run.error
        return run

    first = launch()
    assert built == [1] and "MiB of values mapped" in " ".join(t for _, t in first.phases)
    # Changed behind autograd's back (.data does not bump the version counter): the next launch still sees it.
    with torch.no_grad():
        model.layer1.lin.weight.data.mul_(0.5)
        model.output_proj.bias.add_(1.0)
    second = launch()
    assert built == [1], "the second launch of the same plan and shapes traced torch's Pipe again"
    ref_losses, ref_state = pv.train_reference(model, (x,), y, loss_fn=F.cross_entropy, optimizer=pv.sgd(lr=0.1),
                                               microbatches=4, steps=2)
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    for name, want in ref_state.items():
        torch.testing.assert_close(second.state_dict()[name], want, rtol=0, atol=1e-5, msg=name)
    assert first.losses != second.losses
    # another microbatch count is another trace (the shapes every stage sees are baked in)
    run = pv.launch(plan, "GPipe", 2, steps=1, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(120) == "done", run.error
    assert built == [1, 1]


def test_a_model_changed_after_its_trace_is_refused_before_any_process() -> None:
    model = MyNetwork(8, [8, 8])
    x, y = torch.randn(8, 8), torch.randint(0, 10, (8,))
    plan = pv.trace(model, example_args=(x,)).split(["layer0"])
    model.layer1.lin = nn.Linear(8, 16)
    with pytest.raises(pv.LaunchError, match=r"'layer1.lin.weight' is \(16, 8\) torch.float32, not what pv.trace saw "
                                             r"\(64 elements, 256 bytes\).*Fix: trace it again"):
        pv.launch(plan, "GPipe", 2, steps=1, inputs=(x,), target=y, loss_fn=F.cross_entropy)


def test_a_gone_launchers_values_file_is_swept_from_shared_memory() -> None:
    from pipeviz.runtime.procs import sweep_stale, temp_prefix

    gone = subprocess.Popen(["true"])
    gone.wait()
    folder = ship.values_folder(0)
    dead = os.path.join(folder, f"pipeviz-values-{gone.pid}-abc.values")
    mine = os.path.join(folder, f"{temp_prefix('values')}abc.values")
    for path in (dead, mine):
        with open(path, "wb") as f:
            f.write(b"\0" * 16)
    try:
        removed = sweep_stale()
        assert dead in removed and not os.path.exists(dead)
        assert os.path.exists(mine)  # this process is alive: its files stay
    finally:
        for path in (dead, mine):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.slow
def test_no_room_for_the_values_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from tests.test_faults import left_behind

    def full(prefix: str = "", suffix: str = "", dir: str | None = None) -> tuple[int, str]:
        # a file name where asked, every write failing as on a full disk (/dev/full)
        path = os.path.join(dir or tempfile.gettempdir(), f"{prefix}test{suffix}")
        open(path, "wb").close()
        return os.open("/dev/full", os.O_WRONLY), path

    monkeypatch.setattr(tempfile, "mkstemp", full)
    model = MyNetwork(64, [256, 256])
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    plan = pv.trace(model, example_args=(x,)).split(["layer0"])
    run = pv.launch(plan, "GPipe", 2, steps=1, inputs=(x,), target=y, loss_fn=F.cross_entropy)
    assert run.wait(60) == "failed"
    assert run.error.startswith("No space left in ") and "for the model's values (0.3 MiB, mapped by the ranks)" \
        in run.error and "Fix: free some space there, or point TMPDIR at a disk with room." in run.error, run.error
    assert not left_behind(run)
