import numpy as np
import pytest

from mmpipe.model.geometry import SampleFeatures
from mmpipe.model.spec import layer_names
from mmpipe.planner.api import PlanProblem, plan_stages
from mmpipe.planner.partition import StagePlan, packed_ffd_partition, parameters_partition, stages_from_names

from .helpers import hardware, model


def _tiles(stages, n):
    return stages[0][0] == 0 and stages[-1][1] == n and all(
        stages[i][1] == stages[i + 1][0] and stages[i][0] < stages[i][1] for i in range(len(stages) - 1))


def test_parameters_partition_minimises_largest_part():
    w = [5, 1, 1, 1, 1, 1, 5, 5]
    st = parameters_partition(w, 3)
    assert _tiles(st, len(w))
    loads = [sum(w[a:b]) for a, b in st]
    assert max(loads) == 8  # e.g. [5,1,1,1] [1,1,5] [5] is optimal (8, 7, 5)
    assert len(parameters_partition([1, 1, 1], 3)) == 3


def test_packed_ffd_partition_puts_encoders_on_stage0():
    names = layer_names(model("qwen2-vl-7b"))
    kinds = [".".join(n.split(".")[:2]) for n in names]
    st = packed_ffd_partition(kinds, 4)
    assert _tiles(st, len(names))
    assert names[st[0][1] - 1].startswith("llm.block")
    blocks = [sum(kinds[i] == "llm.block" for i in range(a, b)) for a, b in st]
    assert max(blocks) - min(blocks) <= 1


def test_stage_plan_must_tile():
    with pytest.raises(ValueError, match="tile the layers"):
        StagePlan(stages=[(0, 3), (4, 6)])


def test_stages_from_names():
    names = layer_names(model("tiny"))
    st = stages_from_names([("vision.embed", "audio.proj"), ("llm.embed", "llm.head")], names)
    assert st == [(0, 8), (8, 15)]
    with pytest.raises(ValueError, match="plan.stages\\[1\\] names layer 'llm.blok.0'"):
        stages_from_names([("vision.embed", "audio.proj"), ("llm.blok.0", "llm.head")], names)


def _img(text, tok=576, pos=577):
    return SampleFeatures(image_positions=(pos,), image_tokens=(tok,), audio_positions=(),
                          audio_tokens=(), text_tokens=text)


def test_pp_larger_than_layers_is_an_error():
    with pytest.raises(ValueError, match="parallel.pp=99 is larger than the 15 layers of model tiny"):
        plan_stages(PlanProblem(model=model("tiny"), hardware=hardware("cpu"), pp=99, dp=1, trainable=("all",),
                                micro_batches=2, policy="data-aware"), [_img(10, 4, 16)])


@pytest.mark.parametrize("policy", ["data-aware", "ds-default", "llava-grouped", "packed-ffd"])
def test_plan_stages_tiles_every_layer(policy):
    m = model("llava-1.5-7b")
    rng = np.random.default_rng(0)
    sample = [_img(int(t)) for t in rng.integers(20, 600, 64)]
    sp = plan_stages(PlanProblem(model=m, hardware=hardware("h100"), pp=4, dp=2, trainable=("vision.proj", "llm"),
                                 micro_batches=4, policy=policy), sample)
    assert sp.pp == 4 and _tiles(sp.stages, len(layer_names(m))) and len(sp.recompute) == 4


def test_no_stage_recomputes_where_memory_does_not_ask_for_it():
    """The tiny model at pp=4 on the cpu preset (24 GB): nothing comes near memory, and the last
    stage (norm and head) is off the critical path, so recomputing there costs no simulated time
    but a second forward of its layers in a real step. The search, which starts with recompute
    on everywhere, used to leave it on there."""
    rng = np.random.default_rng(0)
    sample = [_img(int(t), 16, 20) for t in rng.integers(10, 120, 64)]
    sp = plan_stages(PlanProblem(model=model("tiny"), hardware=hardware("cpu"), pp=4, dp=1, trainable=("all",),
                                 micro_batches=8, policy="data-aware"), sample)
    assert sp.stages == ((0, 10), (10, 12), (12, 13), (13, 15))
    assert sp.recompute == (False, False, False, False)
