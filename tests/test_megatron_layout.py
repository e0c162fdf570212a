"""A plan as Megatron-Core's ``--pipeline-model-parallel-layout`` string and back (``pv.megatron_layout``,
``graph.split_megatron``): round trips over the HF matrix's families, Megatron's own parser where it imports, and
every refusal naming what the model has."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest
import torch

import pipeviz as pv
from pipeviz.plan.megatron import format_layout, parse_layout, stack
from tests.compat import ROWS, Row, inputs


def _trace(row: Row) -> pv.ModelGraph:
    torch.manual_seed(0)
    args, kwargs, _ = inputs(row)
    return pv.trace(row.build(), example_args=args, example_kwargs=kwargs)


def _stages(plan: pv.SplitPlan) -> list[tuple[str, ...]]:
    return [s.layers for s in plan.stages]


def _layouts(blocks: int) -> list[str]:
    """Layouts over ``blocks`` blocks: even, uneven, the embedding or the head alone, one block per stage."""
    return [format_layout(s) for s in (
        [["E", *["t"] * blocks, "L"]],
        [["E", "t"], ["t"] * (blocks - 2), ["t", "L"]],
        [["E"], ["t"] * blocks, ["L"]],
        [["E", *["t"] * (blocks - 1)], ["t", "L"]],
        [["E"], *[["t"]] * (blocks - 1), ["t", "L"]],
        [["E", "t"], *[["t"]] * (blocks - 1), ["L"]],
    )]


ONE_STACK = [r for r in ROWS if r.kind != "s2s"]


def _megatron_parser() -> Any:
    """Megatron-Core's own layout class (0.19; it imports triton), or a skip saying why not."""
    try:
        module = importlib.import_module("megatron.core.transformer.pipeline_parallel_layer_layout")
    except ImportError as exc:  # megatron-core is not a pipeviz dependency (it needs Python >= 3.12 and triton)
        pytest.skip(f"megatron-core's layout parser does not import here ({exc}); pipeviz's parser follows its "
                    "grammar (megatron/core/transformer/pipeline_parallel_layer_layout.py)")
    return module.PipelineParallelLayerLayout


# Four families (a fused-attention GPT, a rotary decoder, an MoE decoder, an encoder) in `make test`; the rest of the
# matrix (1-2 s each on 2 cores) in `make compat`, which CI runs too.
DEFAULT_ROWS = {"GPT-2", "Llama", "Qwen2-MoE", "BERT"}


@pytest.mark.slow
@pytest.mark.parametrize("row", [r if r.name in DEFAULT_ROWS else pytest.param(r, marks=pytest.mark.compat)
                                 for r in ONE_STACK], ids=[r.name for r in ONE_STACK])
def test_layouts_round_trip_on_the_matrix_models(row: Row) -> None:
    graph = _trace(row)
    st = stack(graph)
    n = len(st.blocks)
    for layout in _layouts(n):
        plan = graph.split_megatron(layout)
        assert pv.megatron_layout(plan) == layout  # string -> plan -> string
        tokens = parse_layout(layout)
        assert plan.num_stages == len(tokens)
        for stage, toks in zip(plan.stages, tokens, strict=True):  # each stage holds its t blocks and no others
            assert sum(1 for b in st.blocks if b in stage.layers) == toks.count("t")
    # plan -> string -> plan, from plans made by hand at block boundaries (not by split_megatron)
    for spec in ([st.blocks[0]], [st.blocks[1], st.blocks[-1]], {st.blocks[0]: pv.SplitPoint.BEGINNING}):
        plan = graph.split(spec)
        again = graph.split_megatron(pv.megatron_layout(plan))
        assert _stages(again) == _stages(plan), (spec, pv.megatron_layout(plan))


def test_repeats_uneven_stages_and_megatrons_own_example() -> None:
    stages = parse_layout("Et*3|(tt|)*29,m|L".replace("m", "t"))  # Megatron's documented example, its MTP as t
    assert len(stages) == 32 and stages[0] == ["E", "t", "t", "t"] and stages[1:30] == [["t", "t"]] * 29
    assert stages[30:] == [["t"], ["L"]]
    assert parse_layout("E||t|L") == [["E"], [], ["t"], ["L"]]  # an empty stage, as Megatron reads it
    layout = format_layout([["E", "t", "t", "t"], *[["t"] * 4] * 3, ["t", "t", "t", "L"]])
    assert layout == "Et*3|(t*4|)*3,t*3L"
    assert format_layout([["E", "t"], ["t"], ["t", "L"]]) == "Et|t|tL"
    assert format_layout([["E"], [], [], ["t", "L"]]) == "E|(|)*2,tL"
    assert parse_layout("E|(|)*2,tL") == [["E"], [], [], ["t", "L"]]


def test_a_deeper_model_uneven_and_with_repeats() -> None:
    from pipeviz import zoo

    graph = pv.trace(zoo.gpt2(n_layer=12, n_embd=32, n_head=4, vocab_size=64),
                     example_args=(torch.randint(0, 64, (2, 8)),))
    layout = "Ett|(t*3|)*2,t*4L"
    plan = graph.split_megatron(layout)
    assert [sum(1 for n in s.layers if re.fullmatch(r"transformer\.h\.\d+", n)) for s in plan.stages] == [2, 3, 3, 4]
    assert pv.megatron_layout(plan) == layout
    # the same layout spelt otherwise (Megatron's grammar: commas, t*2, groups unrolled) is the same plan
    assert _stages(graph.split_megatron("E,t*2|t*3|ttt|t*4,L")) == _stages(plan)
    balanced = pv.balance(graph, 4, by="params")
    assert _stages(graph.split_megatron(pv.megatron_layout(balanced))) == _stages(balanced)


def test_megatrons_own_parser_reads_every_layout_as_pipeviz_does() -> None:
    parser = _megatron_parser()
    from tests.compat import ROWS as rows

    graph = _trace(next(r for r in rows if r.name == "Llama"))
    blocks = len(stack(graph).blocks)
    names = {"embedding": "E", "decoder": "t", "loss": "L"}
    for layout in [*_layouts(blocks), pv.megatron_layout(pv.balance(graph, 2, by="params"))]:
        plan = graph.split_megatron(layout)
        ours = parse_layout(pv.megatron_layout(plan))
        for pp in (d for d in range(1, plan.num_stages + 1) if plan.num_stages % d == 0):
            theirs = parser(pv.megatron_layout(plan), pp)
            theirs.validate_layer_layout(blocks, None)
            stages = [[names[t.name] for t in theirs.layout[r][v]] for v in range(plan.num_stages // pp)
                      for r in range(pp)]
            assert stages == ours


def test_splits_megatron_cannot_place_are_refused_naming_where() -> None:
    from pipeviz import zoo

    graph = pv.trace(zoo.llama(), example_args=(torch.randint(0, 512, (2, 8)),))
    with pytest.raises(pv.PlanError, match=r"inside block 'model\.layers\.1'.*END of 'model\.layers\.0'"):
        pv.megatron_layout(graph.split(["model.layers.1.self_attn"]))
    with pytest.raises(pv.PlanError, match=r"after the last block in two.*END of 'model\.layers\.3'"):
        pv.megatron_layout(graph.split(["model.norm"]))
    with pytest.raises(pv.PlanError, match=r"before the first block in two.*END of 'model\.rotary_emb'"):
        pv.megatron_layout(graph.split(["model.embed_tokens"]))


@pytest.fixture(scope="module")
def llama_graph() -> pv.ModelGraph:
    """The zoo's tiny Llama traced once for the refusals below (a graph is read, never changed, by split_megatron)."""
    from pipeviz import zoo

    return pv.trace(zoo.llama(), example_args=(torch.randint(0, 512, (2, 8)),))


@pytest.mark.parametrize(("layout", "message"), [
    ("Ettt|tttL", r"places 6 transformer layers \(t\); 'model\.layers' holds 4 blocks \('model\.layers\.0' \.\.\. "
                  r"'model\.layers\.3'\)\. Fix: 4 t in all, e\.g\. 'Ett\|ttL'"),
    ("E||t*4|L", r"stage 1 is empty.*'E\|t\*4\|L'"),
    ("tE|t*3L", r"E \(embedding\) must come once, as the first token"),
    ("Et*4|LL", r"L \(loss head\) must come once, as the last token.*found 2"),
    ("Et*4x|L", r"'x' in stage 0 is not a layer\. Valid: E \(embedding\), t"),
    ("Et*3|tm|L", r"stage 1 holds an MTP layer \(m\)"),
])
def test_layouts_the_model_cannot_take_are_refused(layout: str, message: str, llama_graph: pv.ModelGraph) -> None:
    with pytest.raises(pv.PlanError, match=message):
        llama_graph.split_megatron(layout)


@pytest.mark.slow
def test_models_without_one_stack_of_blocks_are_refused_naming_what_they_have() -> None:
    from pipeviz import zoo

    plain = pv.trace(zoo.MyNetwork(16, [16, 16]), example_args=(torch.randn(4, 16),))
    with pytest.raises(pv.PlanError, match=r"MyNetwork has no stack of transformer blocks.*layer0, layer1"):
        plain.split_megatron("E|t|L")
    with pytest.raises(pv.PlanError, match=r"MyNetwork has no stack"):
        pv.megatron_layout(plain.split(["layer0"]))
    t5 = _trace(next(r for r in ROWS if r.name == "T5"))
    with pytest.raises(pv.PlanError, match=r"2 stacks of blocks \(encoder\.block, decoder\.block\)"):
        t5.split_megatron("Et|tL")


@pytest.mark.slow
def test_the_cli_prints_the_best_rows_megatron_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeviz import cli

    assert cli.main(["plan", "--model", "llama-3-8b", "--gpus", "16", "--global-batch", "64", "--top", "1",
                     "--export", "megatron"]) == 0
    out = capsys.readouterr().out
    layout = re.search(r"--pipeline-model-parallel-layout '([^']+)'", out)
    pp = re.search(r"--pipeline-model-parallel-size (\d+)", out)
    assert layout and pp, out
    stages = parse_layout(layout.group(1))
    assert sum(s.count("t") for s in stages) == 32 and len(stages) % int(pp.group(1)) == 0
    assert "--global-batch-size 64" in out
