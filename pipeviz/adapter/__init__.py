"""Every place pipeviz touches torch internals (torch 2.13–2.15), in one package.

- ``flatten_stage``: torch's stage submodules are unflattened ``InterpreterModule`` trees that cannot be
  pickled; each is turned into one flat ``fx.GraphModule`` (pure torch: no model class needed to run it),
  so the parent traces once and each rank receives only its own stage. Parameters get the original model's
  canonical names, so a tensor used twice in a stage (T5's shared embedding) is one parameter.
- ``compiled_submodules``: the same stage modules run as generated code, not through ``torch.fx.Interpreter``
  (``plan.stage_modules()``: a third off an HF stage's forward).
- ``split_graph``: the top-level graph of a ``Pipe`` (which stage reads which value).
- ``timed_waits``: times blocking communication waits inside torch's schedules.
- ``fake_tensors``: run stages on fake tensors to learn their shapes without computing or touching any
  real tensor (BatchNorm statistics stay as they are).
- ``exact_split_backward``: zero-bubble schedules split a backward into input grads (I) and weight grads
  (W); torch 2.13 gives no gradient at all to a weight whose path to the stage's outputs never meets the
  inputs' path (OPT's and BART's learned positions, a stage computing only position embeddings), and its W
  pass frees graph parts that another weight group still needs (T5's relative attention bias).
- ``schedule_actions``: the action order torch's multi-stage schedules build in their constructor;
  ``schedules.overlap_pairs``: where in it DualPipeV's overlapped F/B pairs (``OVERLAP_F_B``) fall.
- ``overlap_fb`` (module): an ``OVERLAP_F_B`` action's forward and backward run at once (``ep_overlap``).
- ``runtime_schedule``: a custom order (``LaunchConfig.order``) run by torch's ``_PipelineScheduleRuntime``.
- ``regions_inlined``: torch's ``pipeline()`` over a graph whose grad-mode / autocast regions are inlined.
- ``timed_collectives``: times DTensor's functional collectives (tensor parallelism) from launch to wait.
- ``timed_stage_class``: torch's ``PipelineStage`` with its three action methods timed (``check_stage_methods``
  compares their signatures with the installed torch's).

Modules: ``flat`` (flattening, names, failing ops), ``fake`` (fake tensors), ``backward`` (split backwards),
``schedules`` (Pipe graph, waits, action orders, regions), ``stage`` (the timed stage), ``collectives``.

``tests/test_adapter.py`` checks each against the installed torch, so a torch whose internals changed
fails there loudly, not in a worker.
"""

from pipeviz.adapter.backward import exact_split_backward
from pipeviz.adapter.collectives import COLLECTIVES, plant_fault, timed_collectives
from pipeviz.adapter.fake import defake, fake_cpu, fake_tensors
from pipeviz.adapter.flat import FlatStage, canonical_name, compiled_submodules, describe, flatten_stage
from pipeviz.adapter.schedules import regions_inlined, runtime_schedule, schedule_actions, split_graph, timed_waits
from pipeviz.adapter.stage import OVERRIDDEN, check_stage_methods, timed_stage_class

__all__ = ["COLLECTIVES", "OVERRIDDEN", "FlatStage", "canonical_name", "check_stage_methods", "compiled_submodules",
           "defake", "describe", "exact_split_backward", "fake_cpu", "fake_tensors", "flatten_stage", "plant_fault",
           "regions_inlined", "runtime_schedule", "schedule_actions", "split_graph", "timed_collectives",
           "timed_stage_class", "timed_waits"]
