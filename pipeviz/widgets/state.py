"""``ExplorerState``: what the Explorer holds, without a widget: the plan and its history (undo, redo), the settings
its controls make and the one ``pv.LaunchConfig`` they describe, and why that configuration cannot launch.

The Explorer is a view over one of these (controls -> state -> ``LaunchConfig``); everything here runs headless,
importing neither ipywidgets nor plotly, so a script or a test drives it as the widget does.

Example:
    >>> state = ExplorerState(pv.trace(model, (x,)), pv.LaunchConfig(schedule="1F1B", microbatches=4))
    >>> state.toggle("layer0"); state.plan.num_stages          # 2
    >>> state.update(microbatches=5); str(state.refusal())      # 'microbatches 5 cannot launch: it does not ...'
    >>> state.undo(); state.plan.num_stages                     # 1
    >>> pv.launch(state.plan, state.launch_config(), inputs=(x,), target=y)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

import pipeviz as pv
from pipeviz.capture.view import GraphView
from pipeviz.errors import LaunchError
from pipeviz.plan.split import SplitPlan
from pipeviz.runtime.checks import validate_launch
from pipeviz.schedule import traits as sched
from pipeviz.schedule.config import LaunchConfig
from pipeviz.schedule.timeline import Timeline
from pipeviz.schedule.training import cross_entropy, default_target
from pipeviz.widgets import refusals

if TYPE_CHECKING:
    import os

    from pipeviz.planner.cluster import LayoutOption

__all__ = ["HERE", "MODES", "ExplorerState", "Settings"]

HERE = "this machine"  # the cost setting's default: costs measured or estimated here, in the traced dtype
MODES = ("train", "infer")  # the run switch: train, or forward only


@dataclass(frozen=True)
class Settings:
    """What the Explorer's controls set: the run's schedule, microbatches, steps, mode (train or infer) and layout
    (``dp``, ``tp``, ``cp``, ``ep``, sequence parallelism), and what the costs assume (``hardware``: ``HERE`` or a GPU
    preset, ``recompute``)."""

    schedule: str = "1F1B"
    microbatches: int = 4
    steps: int = 1
    mode: str = "train"
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    hardware: str = HERE
    cp: int = 1  # context-parallel shares of every sequence
    ep: int = 1  # expert-parallel shares of every MoE block's routed experts (carved out of dp)
    recompute: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {list(MODES)}. Fix: mode='train' to train, or "
                             "mode='infer' for a forward-only run.")


def _stage_bound(exc: BaseException) -> bool:
    """A refusal that depends on the stage count (the schedule's layout and microbatch rules, a custom order, torch's
    sends and receives): not said from a stand-in two-stage split."""
    return isinstance(exc, sched.ScheduleError) or getattr(exc, "setting", None) in ("schedule", "microbatches",
                                                                                      "order")


def _shown(value: object) -> str:
    return "on" if value is True else "off" if value is False else str(value)


class ExplorerState:
    """The Explorer's model: plan history, settings, the launch configuration and its refusal, headless.

    Args:
        graph: the traced model (``pv.trace``); expand / collapse replace it (``state.graph``).
        config: the user's ``pv.LaunchConfig`` (``state.config``): its other options (timeouts, pinning, ...) go
            into every configuration the settings make.
        settings: the controls' starting values (default: ``config``'s schedule, microbatches, steps, dp, tp).
        target, loss_fn, optimizer, eval_data, resume: what a training Launch takes (``pv.Explorer``'s).

    Attributes:
        plan: the current ``SplitPlan`` (``set_plan``, ``toggle``, ``balance``, ``undo``, ``redo`` change it).
        settings: the current ``Settings`` (``update`` changes them).
        loaded: the cluster row last loaded (its costs, while the cost settings still match it), else None.
    """

    def __init__(self, graph: GraphView, config: LaunchConfig, settings: Settings | None = None, *,
                 target: torch.Tensor | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                 eval_data: Iterable[object] | None = None, resume: str | os.PathLike[str] | None = None) -> None:
        self.graph = graph
        self.config = config
        self.settings = settings or Settings(sched.canonical(config.schedule), config.microbatches, config.steps or 1,
                                             dp=config.dp, tp=config.tp, sequence_parallel=config.sequence_parallel,
                                             cp=config.cp, ep=config.ep)
        self.target, self.devices = target, config.devices
        self.loss_fn, self.optimizer = loss_fn or config.loss_fn, optimizer or config.optimizer
        self.eval_data = list(eval_data) if eval_data is not None else None  # held-out batches (train mode)
        self.resume = resume  # a checkpoint a training Launch continues from
        self.loaded: LayoutOption | None = None
        self.plan = cast(SplitPlan, graph.split([]))
        self._history: list[SplitPlan] = []
        self._future: list[SplitPlan] = []
        self._target: torch.Tensor | None = None  # the default target, made once
        self._launched: tuple[SplitPlan, Settings] | None = None  # what the last Launch ran (``launched``)

    # ----------------------------------------------------------------- the plan and its history
    def set_plan(self, value: SplitPlan | Iterable[str], record: bool = True) -> SplitPlan:
        """Make ``value`` (a plan, or layer names to split after) the plan; ``record``: undo can bring the one
        before back. Its graph becomes ``state.graph`` (a plan on an expanded or collapsed graph)."""
        if not isinstance(value, SplitPlan):
            value = cast(SplitPlan, self.graph.split(list(value)))
        if record and value != self.plan:
            self._history.append(self.plan)
            self._future.clear()
        self.graph, self.plan = value.graph, value
        return value

    def toggle(self, layer: str) -> SplitPlan:
        """Split after ``layer``, or remove the split there (a click on its node); raises on an invalid layer."""
        return self.set_plan(self.plan.toggle(layer))

    def undo(self) -> SplitPlan:
        """Back to the plan before the last change (splits, balance, expand or collapse)."""
        if self._history:
            self._future.append(self.plan)
            self.set_plan(self._history.pop(), record=False)
        return self.plan

    def redo(self) -> SplitPlan:
        """Redo the change ``undo`` took back."""
        if self._future:
            self._history.append(self.plan)
            self.set_plan(self._future.pop(), record=False)
        return self.plan

    @property
    def can_undo(self) -> bool:
        return bool(self._history)

    @property
    def can_redo(self) -> bool:
        return bool(self._future)

    def expand(self, name: str) -> SplitPlan:
        """Layer ``name``'s child modules as layers (no re-tracing); splits are kept."""
        return self.set_plan(self.plan.onto(self.graph.expand(name)))

    def collapse(self, name: str) -> SplitPlan:
        """Every layer inside module ``name`` merged into one (splits inside it dropped)."""
        return self.set_plan(self.plan.onto(self.graph.collapse(name)))

    def regroup(self, depth: int | None = None) -> SplitPlan:
        """Another granularity: ``None`` for the natural blocks, an int for every module down to that depth."""
        return self.set_plan(self.plan.onto(self.graph.regroup(depth)))

    def balance(self, num_stages: int, by: str = "time") -> SplitPlan:
        """``pv.balance(graph, num_stages, by=...)`` made the plan; among splits tied at the optimum, the one the
        simulator gives the shortest step under the settings' run."""
        cfg = self.launch_config()  # the tie-break simulates the run Launch would run
        try:
            plan = pv.balance(self.graph, num_stages, by=by, schedule=cfg.schedule, microbatches=cfg.microbatches,
                              stages_per_rank=cfg.layout(num_stages).stages_per_rank, options=self.cost_options())
        except pv.ScheduleError:  # the schedule cannot run that many stages: balance without the tie-break
            plan = pv.balance(self.graph, num_stages, by=by, options=self.cost_options())
        return self.set_plan(plan)

    # ----------------------------------------------------------------- the settings and the configuration
    def update(self, **changes: Any) -> Settings:
        """New settings (``schedule=``, ``microbatches=``, ``dp=``, ... : ``Settings``' fields); an unknown one is
        named with the valid ones."""
        fields = [f.name for f in dataclasses.fields(Settings)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise TypeError(f"Unknown setting(s) {unknown}; valid: {', '.join(fields)}.")
        self.settings = dataclasses.replace(self.settings, **changes)
        return self.settings

    def launch_config(self, settings: Settings | None = None) -> LaunchConfig:
        """The ``pv.LaunchConfig`` Launch runs: ``config`` with the settings' schedule, microbatches, steps, dp, tp and
        recomputation (in infer mode: no loss, optimizer, clipping, accumulation, scheduler, evaluation or
        recomputation); ``pv.export_torchrun(plan, path, config=state.launch_config())`` writes the same run.
        ``settings``: other settings than the current ones."""
        s, base = settings or self.settings, self.config
        infer = s.mode == "infer"
        return base.replace(
            schedule=s.schedule, microbatches=s.microbatches, steps=s.steps,
            stages_per_rank=base.stages_per_rank if sched.info(s.schedule).multi else None,
            loss_fn=None if infer else self.loss_fn or cross_entropy, optimizer=None if infer else self.optimizer,
            clip_grad_norm=None if infer else base.clip_grad_norm, accumulate=1 if infer else base.accumulate,
            lr_scheduler=None if infer else base.lr_scheduler,
            eval_every=None if infer or self.eval_data is None else base.eval_every,
            devices=self.devices, dp=s.dp, tp=s.tp, cp=s.cp, ep=s.ep,
            sequence_parallel=bool(s.sequence_parallel) and s.tp > 1,
            recompute="none" if infer else s.recompute)

    def cost_options(self) -> pv.CostOptions:
        """The cost model's settings (hardware, its dtype, recomputation): what the preview, Balance and the simulated
        timeline use. ``HERE`` is the default ``pv.CostOptions()`` (profiled layer times, the traced dtype); a GPU
        preset costs each op by its roofline in bfloat16; a loaded cluster row, its own."""
        row = self.loaded_row()
        if row is not None:  # a cluster row's own costs: its dtype, batch scale, sequence length
            return row.options
        if self.settings.hardware == HERE:
            return pv.CostOptions(recompute=self.settings.recompute)
        return pv.CostOptions(hardware=self.settings.hardware, dtype="bfloat16", recompute=self.settings.recompute)

    def loaded_row(self) -> LayoutOption | None:
        """The loaded cluster row, while the cost settings are still on its hardware and recomputation."""
        row = self.loaded
        hw = row.options.hw if row is not None else None
        if row is None or hw is None or hw.name != self.settings.hardware or row.recompute != self.settings.recompute:
            return None
        return row

    def launch_target(self) -> torch.Tensor:
        """The target a training Launch takes: ``target``, else random classes of the output's last dim (seed 0)."""
        if self.target is not None:
            return self.target
        if self._target is None:
            self._target = default_target(self.graph)
        return self._target

    # ----------------------------------------------------------------- what Launch would say
    def refusal(self) -> LaunchError | None:
        """Why Launch would refuse the settings and the plan, as one sentence naming the control (or the click), why,
        the valid values and the fix (its ``.setting`` names the control), else None. Everything ``pv.launch``
        checks before a process starts runs at every change (a few ms), whatever the stage count: at one stage the
        checks that do not depend on the stage count run on a two-stage split of the graph, then the single stage
        itself is the refusal."""
        cfg = self.launch_config()
        own = self._own_refusal(cfg)
        if own is not None:
            return own
        plan = self.plan if self.plan.num_stages > 1 else self._probe()
        exc = self._validate(cfg, plan) if plan is not None else None
        if exc is not None and (plan is self.plan or not _stage_bound(exc)):
            setting = getattr(exc, "setting", None)
            valid = self._valid(setting, plan) if plan is not None and setting in ("schedule", "tp", "ep") else None
            return refusals.one_sentence(exc, cfg, valid)
        return refusals.stages_refusal(self.plan)

    def _own_refusal(self, cfg: LaunchConfig) -> LaunchError | None:
        """The settings that can never launch on this batch, at any stage count (``refusals``)."""
        batch = self.graph.batch_size
        return (refusals.forward_only_refusal(cfg) or refusals.dp_refusal(cfg, batch)
                or refusals.microbatches_refusal(self.plan, cfg, batch))

    def _probe(self) -> SplitPlan | None:
        """A two-stage split of the graph (after its middle layer, else the nearest that splits), on which the
        checks that do not depend on the stage count run before the first click; None for a graph that cannot
        split."""
        names = self.graph.layer_names[:-1]
        for name in sorted(names, key=lambda n: abs(names.index(n) - (len(names) - 1) / 2)):
            try:
                return self.plan.toggle(name)
            except ValueError:  # no module runs after it, ...
                continue
        return None

    def _validate(self, cfg: LaunchConfig, plan: SplitPlan | None = None) -> BaseException | None:
        """What ``pv.launch`` would raise first for ``plan`` (default: the plan) and ``cfg`` before any process
        starts, else None."""
        args, kwargs = self.graph.example_args, dict(self.graph.example_kwargs)
        try:  # (the default target inside too: a model with several outputs has none)
            validate_launch(plan or self.plan, cfg, inputs=args, input_kwargs=kwargs or None,
                            target=None if cfg.loss_fn is None else self.launch_target(),
                            eval_data=None if cfg.loss_fn is None else self.eval_data)
        except Exception as exc:  # LaunchError, ScheduleError, PlanError, or whatever else Launch would meet first
            return exc
        return None

    def _valid(self, setting: str, plan: SplitPlan) -> list[str]:
        """The values of ``schedule`` (every one), ``tp`` (1, 2, 4, 8) or ``ep`` (the divisors of dp × cp) that would
        launch on ``plan`` with the other settings as they are (checked only once a refusal is shown)."""
        s = self.settings
        tries = ([dataclasses.replace(s, schedule=n) for n in sched.ALL] if setting == "schedule" else
                 [dataclasses.replace(s, ep=k) for k in refusals.divisors(s.dp * s.cp)] if setting == "ep" else
                 [dataclasses.replace(s, tp=k) for k in (1, 2, 4, 8)])
        configs = [(s, self.launch_config(s)) for s in tries]
        return [str(getattr(s, setting)) for s, cfg in configs
                if self._own_refusal(cfg) is None and self._validate(cfg, plan) is None]

    def launch_refusal(self) -> LaunchError | None:
        """What Launch says when pressed: ``refusal()`` (the single stage included since round 3)."""
        return self.refusal()

    # ----------------------------------------------------------------- the run Launch started
    def launched(self) -> None:
        """Launch started a run of the plan and the settings now: ``changes_since_launch`` compares with them."""
        self._launched = (self.plan, self.settings)

    def changes_since_launch(self) -> list[str]:
        """What changed since the last Launch, in the controls' words (``"microbatches 4 → 8"``, ``"the split"``):
        any change of the plan or of a setting the run was launched with makes the run out of date (the cost
        settings only price the simulation: not counted). Empty before any Launch."""
        if self._launched is None:
            return []
        plan, then = self._launched
        changed = [] if plan == self.plan else ["the split"]
        for f in dataclasses.fields(Settings):
            was, now = getattr(then, f.name), getattr(self.settings, f.name)
            if f.name not in ("hardware", "recompute") and was != now:
                changed.append(f"{refusals.LABELS.get(f.name, f.name)} {_shown(was)} → {_shown(now)}")
        if then.recompute != self.settings.recompute and self.settings.mode == "train":  # (Launch runs it)
            changed.append(f"recompute {then.recompute} → {self.settings.recompute}")
        return changed

    def simulate(self) -> Timeline | None:
        """The settings' run simulated on the plan (None at one stage); a loaded cluster row's on its own batch and
        collectives. Raises ``ScheduleError`` / ``ValueError`` when the schedule does not fit the plan."""
        if self.plan.num_stages < 2:
            return None
        row = self.loaded_row()
        return pv.simulate(self.plan, self.launch_config(), options=self.cost_options(),
                           collectives=row.collectives if row is not None else None)

    def __repr__(self) -> str:
        s = self.settings
        return f"ExplorerState({self.plan!r}, schedule={s.schedule}, microbatches={s.microbatches}, mode={s.mode})"
