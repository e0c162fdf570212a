"""A model, loss and optimizer defined in notebook cells (``__main__``) train through pv.launch."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

CELLS = [
    """
import time, torch, torch.nn.functional as F
from torch import nn
import pipeviz as pv

class NotebookNet(nn.Module):          # defined in __main__: workers get it by value
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) + h)

def notebook_loss(out, target):
    return F.cross_entropy(out, target)

torch.manual_seed(0)
model, x, y = NotebookNet(), torch.randn(8, 8), torch.randint(0, 4, (8,))
plan = pv.trace(model, example_args=(x,)).split(["a", "b"])
""",
    """
run = pv.launch(plan, schedule="1F1B", microbatches=4, steps=20, inputs=(x,), target=y, loss_fn=notebook_loss,
                optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
ticks = 0
while not run.done:      # the kernel keeps running cells while the stages train
    ticks += 1
    time.sleep(0.01)
assert run.status == "done", run.error
ref_losses, ref_state = pv.train_reference(model, (x,), y, loss_fn=notebook_loss,
                                           optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), microbatches=4,
                                           steps=20)
assert max(abs(a - b) for a, b in zip(run.losses, ref_losses)) < 1e-5
assert all((run.state_dict()[k] - v).abs().max() < 1e-5 for k, v in ref_state.items())
second = pv.launch(plan, schedule="GPipe", microbatches=2, steps=1, inputs=(x,), target=y, loss_fn=notebook_loss)
assert second.wait(120) == "done", second.error
print("OK", ticks > 10, torch.cuda.is_initialized())
""",
]


def test_notebook_defined_model_trains(tmp_path: object) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert out.strip() == "OK True False"
