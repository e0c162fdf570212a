"""``pv.export_torchtitan``: a plan and its launch configuration as torchtitan's ``[parallelism]`` fields, read back
with tomllib, by torch's own schedule-CSV loader (what torchtitan calls for a custom order), and by torchtitan's own
config classes where torchtitan imports."""

from __future__ import annotations

import csv
import importlib
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipeviz as pv
from pipeviz import zoo
from pipeviz.runtime.torchtitan import module_fqns
from pipeviz.schedule import traits as sched


class TitanBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = nn.Linear(dim, dim)
        self.feed_forward = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(torch.relu(self.attention(x)))


class TitanStyle(nn.Module):
    """A decoder named as torchtitan's own models are: tok_embeddings, layers (a ModuleDict), norm, output."""

    def __init__(self, vocab: int = 64, dim: int = 16, n: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim) for i in range(n)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


@pytest.fixture(scope="module")
def titan() -> pv.ModelGraph:
    torch.manual_seed(0)
    return pv.trace(TitanStyle(), example_args=(torch.randint(0, 64, (16, 8)),))


@pytest.fixture(scope="module")
def llama() -> pv.ModelGraph:
    return pv.trace(zoo.llama(), example_args=(torch.randint(0, 512, (8, 16)),))


def _read(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def test_the_fragment_holds_the_plan_and_the_layout_in_torchtitans_names(titan: pv.ModelGraph, tmp_path: Path) -> None:
    plan = titan.split(["layers.1"])
    cfg = pv.LaunchConfig(schedule="gpipe", microbatches=4, dp=2, tp=2, cp=2)
    data = _read(pv.export_torchtitan(plan, cfg, tmp_path / "pp.toml"))
    assert data["parallelism"] == {
        "pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "GPipe",
        "pipeline_parallel_microbatch_size": 2,  # the traced 16 over 2 replicas, in 4 microbatches
        "module_fqns_per_model_part": [["tok_embeddings", "layers.0", "layers.1"],
                                       ["layers.2", "layers.3", "norm", "output"]],
        "data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1, "tensor_parallel_degree": 2,
        "context_parallel_degree": 2}
    assert data["training"] == {"local_batch_size": 8}
    sharded = _read(pv.export_torchtitan(plan, cfg.replace(dp_shard=True, accumulate=3), tmp_path / "fsdp.toml"))
    assert (sharded["parallelism"]["data_parallel_replicate_degree"],
            sharded["parallelism"]["data_parallel_shard_degree"]) == (1, 2)
    assert sharded["training"] == {"local_batch_size": 8, "global_batch_size": 48}


def test_several_stages_per_rank_an_hf_model_and_renamed_prefixes(llama: pv.ModelGraph, tmp_path: Path) -> None:
    plan = llama.split_megatron("Et|t|t|tL")
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=4, stages_per_rank=2)
    par = _read(pv.export_torchtitan(plan, cfg, tmp_path / "a.toml", microbatch_size=3))["parallelism"]
    assert (par["pipeline_parallel_degree"], par["pipeline_parallel_schedule"]) == (2, "Interleaved1F1B")
    assert par["pipeline_parallel_microbatch_size"] == 3
    assert par["module_fqns_per_model_part"] == [
        ["model.embed_tokens", "model.rotary_emb", "model.layers.0"], ["model.layers.1"], ["model.layers.2"],
        ["model.layers.3", "model.norm", "lm_head"]]
    assert "Names nested under model" in (tmp_path / "a.toml").read_text()
    # torchtitan's Hugging Face backend names the same modules tok_embeddings, layers.N, norm, rotary_emb
    hf = {"model.embed_tokens": "tok_embeddings", "model.layers": "layers", "model.norm": "norm",
          "model.rotary_emb": "rotary_emb"}
    assert module_fqns(plan, hf) == [["tok_embeddings", "rotary_emb", "layers.0"], ["layers.1"], ["layers.2"],
                                     ["layers.3", "norm", "lm_head"]]
    # every module the model runs is in exactly one part (plan stages at any granularity)
    deep = llama.split(["model.layers.1.mlp", "model.layers.2"])
    with pytest.raises(pv.PlanError, match=r"share 'model\.layers\.1', an item of 'model\.layers'"):
        module_fqns(deep)
    plain = pv.trace(zoo.MyNetwork(8, [8, 8, 8]), example_args=(torch.randn(4, 8),))
    assert module_fqns(plain.split(["layer0", "layer2"])) == [["layer0"], ["layer1", "layer2"], ["output_proj"]]


def test_a_custom_order_goes_to_a_csv_torchs_loader_reads(titan: pv.ModelGraph, tmp_path: Path) -> None:
    from unittest import mock

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    plan = titan.split(["layers.0", "layers.1", "layers.2"])
    # breadth-first (LoopedBFS's order) on the stages Interleaved1F1B places: a custom order torch has no name for
    order = [list(r) for r in sched.orders("LoopedBFS", 4, 4)]
    assert order != [list(r) for r in sched.orders("Interleaved1F1B", 4, 4)]
    cfg = pv.LaunchConfig(schedule="Interleaved1F1B", microbatches=4, order=order)
    path = pv.export_torchtitan(plan, cfg, tmp_path / "custom.toml")
    par = _read(path)["parallelism"]
    table = Path(par["pipeline_parallel_schedule_csv"])
    assert table == (tmp_path / "custom.schedule.csv").resolve() and table.is_absolute()
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"  # still places the stages (loop layout)
    with open(table, newline="") as f:
        assert sched.order_of(list(csv.reader(f))) == order  # torch's text, read back as the same Actions
    for rank in range(2):  # torch's _load_csv, as torchtitan calls it, on a stand-in for each rank's stages
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod, stage.num_stages = rank, 2, None, 4
        runtime = _PipelineScheduleRuntime([stage, stage], n_microbatches=4)
        runtime._load_csv(str(table))
        assert [str(a) for a in runtime.pipeline_order[rank]] == [str(a) for a in order[rank]]
        assert runtime.stage_index_to_group_rank == {0: 0, 1: 1, 2: 0, 3: 1}
    interleaved = [list(r) for r in sched.orders("Interleaved1F1B", 4, 4)]
    rank1 = interleaved[1]
    stuck = [interleaved[0], [a for a in rank1 if a.kind == "F"] + [a for a in rank1 if a.kind == "B"]]
    with pytest.raises(pv.ScheduleError, match="deadlocks"):  # rank 1 all forwards first: 2F2 waits behind 2B1
        pv.export_torchtitan(plan, cfg.replace(order=stuck), tmp_path / "bad.toml")
    with pytest.raises(pv.ScheduleError, match="0F0 is missing"):
        pv.export_torchtitan(plan, cfg.replace(order=[order[0][1:], order[1]]), tmp_path / "bad.toml")
    assert not (tmp_path / "bad.toml").exists()


def test_what_torchtitan_could_not_run_is_refused_before_writing(titan: pv.ModelGraph, tmp_path: Path) -> None:
    plan = titan.split(["layers.0", "layers.1", "layers.2"])
    with pytest.raises(pv.ScheduleError, match=r"1F1B needs at least as many microbatches as stages \(4\)"):
        pv.export_torchtitan(plan, pv.LaunchConfig(schedule="1F1B", microbatches=2), tmp_path / "x.toml")
    with pytest.raises(pv.ScheduleError, match="stage count divisible by 2"):
        pv.export_torchtitan(titan.split(["layers.0", "layers.1"]), "Interleaved1F1B", tmp_path / "x.toml")
    with pytest.raises(pv.PlanError, match=r"microbatches=3 does not divide the batch of 8"):
        pv.export_torchtitan(plan, pv.LaunchConfig(schedule="GPipe", microbatches=3, dp=2), tmp_path / "x.toml")
    with pytest.raises(pv.PlanError, match=r"dp=3 replicas cannot share the traced batch of 16"):
        pv.export_torchtitan(plan, pv.LaunchConfig(schedule="GPipe", dp=3), tmp_path / "x.toml")
    with pytest.raises(pv.PlanError, match="microbatch_size must be a positive int, got 0"):
        pv.export_torchtitan(plan, "GPipe", tmp_path / "x.toml", microbatch_size=0)
    assert not (tmp_path / "x.toml").exists()


def _torchtitan_reader() -> tuple[str, Any]:
    """torchtitan's own reader of these fields: 0.2's ``ConfigManager`` (TOML, ``--job.config_file``) or 0.3's config
    classes (Python configs; the fields are the same), or a skip saying why neither imports."""
    try:
        manager = importlib.import_module("torchtitan.config.manager")
        if hasattr(manager.ConfigManager, "_maybe_load_toml"):
            return "0.2", manager.ConfigManager
        return "0.3", importlib.import_module("torchtitan.config.configs")
    except ImportError as exc:  # torchtitan is not a pipeviz dependency; 0.2's loader imports triton too
        pytest.skip(f"torchtitan does not import here ({exc}); tomllib checked the fragment above")


def test_torchtitan_reads_the_fragment_itself(titan: pv.ModelGraph, tmp_path: Path) -> None:
    version, reader = _torchtitan_reader()
    cfg = pv.LaunchConfig(schedule="ZBVZeroBubble", microbatches=4, dp=2, tp=2,
                          order=[list(r) for r in sched.orders("ZBVZeroBubble", 4, 4)])
    path = pv.export_torchtitan(titan.split(["tok_embeddings", "layers.1", "layers.2"]), cfg, tmp_path / "t.toml")
    data = _read(path)
    if version == "0.2":
        job = reader().parse_args(["--job.config_file", str(path)])
        par, local = job.parallelism, job.training.local_batch_size
    else:
        par, local = reader.ParallelismConfig(**data["parallelism"]), reader.TrainingConfig(**data["training"])
        local = local.local_batch_size
    assert par.module_fqns_per_model_part == data["parallelism"]["module_fqns_per_model_part"]
    assert (par.pipeline_parallel_degree, par.pipeline_parallel_schedule, par.pipeline_parallel_microbatch_size,
            par.data_parallel_replicate_degree, par.data_parallel_shard_degree, par.tensor_parallel_degree,
            par.context_parallel_degree, local) == (2, "ZBVZeroBubble", 2, 2, 1, 2, 1, 8)
    assert Path(par.pipeline_parallel_schedule_csv).is_file()


@pytest.mark.slow
def test_the_cli_writes_the_best_rows_fragment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeviz import cli

    out = tmp_path / "best.toml"
    assert cli.main(["plan", "--model", "llama-3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1",
                     "--export", "torchtitan", "--export-path", str(out)]) == 0
    assert f"for torchtitan: {out}" in capsys.readouterr().out
    data = _read(out)
    parts = data["parallelism"]["module_fqns_per_model_part"]
    names = [n for part in parts for n in part]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert [n for n in names if n.startswith("model.layers.")] == [f"model.layers.{i}" for i in range(32)]
    p = data["parallelism"]
    assert (p["pipeline_parallel_degree"] * p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
            * p["tensor_parallel_degree"] * p["context_parallel_degree"]) == 16
    assert data["training"]["local_batch_size"] * p["data_parallel_replicate_degree"] \
        * p["data_parallel_shard_degree"] == 64
