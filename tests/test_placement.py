"""Placement rules, without TensorFlow."""

import dataclasses

import pytest

from hybrid_strategy.placement import plan as placement

EMBEDDING = ("Embedding", "Layer", "object")
DENSE = ("Dense", "Layer", "object")


def info(path, shape=(10, 4), classes=DENSE):
    return placement.VariableInfo(path, shape, 4, classes)


def test_hybrid_puts_embeddings_on_ps_and_the_rest_mirrored():
    policy = placement.PlacementPolicy("hybrid", num_ps=1)
    decided = policy.decide(info("emb/embeddings", classes=EMBEDDING))
    assert decided == placement.Placement("ps", (placement.Shard(0, 0, 1, 10),))
    assert policy.decide(info("dense/kernel")) == placement.Placement("mirrored")


def test_embedding_subclasses_are_sparse_layers():
    policy = placement.PlacementPolicy("hybrid", num_ps=1)
    decided = policy.decide(info("tok/embeddings", classes=("TokenEmbedding",) + EMBEDDING))
    assert decided.kind == "ps"
    assert policy.plan["tok/embeddings"].reason == "TokenEmbedding subclasses Embedding"


def test_architectures_allreduce_and_ps():
    allreduce = placement.PlacementPolicy("allreduce", num_ps=2)
    assert allreduce.decide(info("emb/embeddings", classes=EMBEDDING)).kind == "mirrored"
    ps = placement.PlacementPolicy("ps", num_ps=2)
    assert ps.decide(info("dense/kernel")).kind == "ps"


def test_non_layer_variables_stay_mirrored_and_out_of_the_plan():
    policy = placement.PlacementPolicy("ps", num_ps=1)
    assert policy.decide(info("iteration", shape=(), classes=())).kind == "mirrored"
    assert len(policy.plan) == 0


def test_small_tables_stay_whole_balanced_by_bytes():
    policy = placement.PlacementPolicy("hybrid", num_ps=2)
    big = policy.decide(info("a/embeddings", (1000, 8), EMBEDDING))
    small1 = policy.decide(info("b/embeddings", (10, 8), EMBEDDING))
    small2 = policy.decide(info("c/embeddings", (10, 8), EMBEDDING))
    assert (big.ps_tasks, small1.ps_tasks, small2.ps_tasks) == ((0,), (1,), (1,))
    assert policy.plan.bytes_per_ps_task(2) == [32000, 640]


def test_large_tables_split_by_rows_over_every_ps_task():
    policy = placement.PlacementPolicy("hybrid", num_ps=3)
    decided = policy.decide(info("words/embeddings", (100_000, 64), EMBEDDING))
    assert decided.shards == tuple(placement.Shard(k, k, 3, 100_000) for k in range(3))
    assert [s.rows for s in decided.shards] == [33334, 33333, 33333]
    assert policy.plan.bytes_per_ps_task(3) == [33334 * 256, 33333 * 256, 33333 * 256]
    assert str(decided) == "3 shards on ps"
    plan = str(policy.plan)
    assert "rows 0::3" in plan and "rows 2::3" in plan


def test_shard_count_follows_min_shard_bytes_and_table_shards():
    policy = placement.PlacementPolicy(
        "hybrid", num_ps=4, min_shard_bytes=1 << 20, table_shards={"pinned": 2, "tiny*": 3})
    # 3 MiB: three shards of at least 1 MiB, on three distinct tasks.
    three = policy.decide(info("a/embeddings", (3 * (1 << 18), 1), EMBEDDING))
    assert sorted(three.ps_tasks) == [0, 1, 2]
    assert len(policy.decide(info("pinned/embeddings", (10**6, 8), EMBEDDING)).shards) == 2
    # More shards than rows is capped at one row each.
    assert [s.rows for s in policy.decide(info("tiny/embeddings", (2, 8), EMBEDDING)).shards] == [1, 1]


def test_shards_beyond_the_ps_count_wrap_to_least_loaded_tasks():
    policy = placement.PlacementPolicy("hybrid", num_ps=2, table_shards={"t": 4})
    decided = policy.decide(info("t/embeddings", (400, 8), EMBEDDING))
    assert decided.ps_tasks == (0, 1, 0, 1)
    assert [s.rows for s in decided.shards] == [100, 100, 100, 100]


def test_plan_lists_every_shard():
    policy = placement.PlacementPolicy("hybrid", num_ps=2)
    policy.decide(info("words/embeddings", (100_000, 64), EMBEDDING))
    lines = str(policy.plan).splitlines()
    assert lines[1].split()[:4] == ["words/embeddings", "100000x64", "25,600,000", "2"]
    assert lines[2].split() == ["shard", "0", "50000x64", "12,800,000", "/job:ps/task:0",
                                "rows", "0::2"]
    assert lines[3].split()[4:] == ["/job:ps/task:1", "rows", "1::2"]


def test_overrides_match_paths_and_layer_names():
    policy = placement.PlacementPolicy(
        "hybrid", num_ps=1,
        overrides={"emb": "mirrored", "decoder/kernel": "ps", "head*": "ps"})
    assert policy.decide(info("emb/embeddings", classes=EMBEDDING)).kind == "mirrored"
    assert policy.decide(info("decoder/kernel")).kind == "ps"
    assert policy.decide(info("decoder/bias")).kind == "mirrored"
    assert policy.decide(info("head_2/kernel")).kind == "ps"
    assert policy.plan["emb/embeddings"].reason == "override 'emb'"


def test_single_machine_ps_variables_live_on_the_local_cpu():
    policy = placement.PlacementPolicy("hybrid", num_ps=0)
    decided = policy.decide(info("words/embeddings", (100_000, 64), EMBEDDING))
    assert decided == placement.Placement("ps", (placement.Shard(None, 0, 1, 100_000),))
    assert str(decided) == "ps (local CPU)"


def test_plan_prints_a_table():
    policy = placement.PlacementPolicy("hybrid", num_ps=1)
    policy.decide(info("emb/embeddings", (50_000, 64), EMBEDDING))
    policy.decide(info("dense/kernel", (64, 1)))
    lines = str(policy.plan).splitlines()
    assert lines[0].split() == ["variable", "shape", "bytes", "placement", "why"]
    assert lines[1].split()[:4] == ["emb/embeddings", "50000x64", "12,800,000", "/job:ps/task:0"]
    assert lines[2].split()[:4] == ["dense/kernel", "64x1", "256", "mirrored"]


@pytest.mark.parametrize("kwargs, message", [
    ({"architecture": "mixed"}, "architecture='mixed' is not supported"),
    ({"num_ps": -1}, "num_ps must be an int >= 0"),
    ({"overrides": ["emb"]}, "placement_overrides must be a dict"),
    ({"overrides": {"emb": "gpu"}}, "placement_overrides['emb'] is 'gpu'"),
    ({"overrides": {"": "ps"}}, "must be a non-empty string"),
    ({"min_shard_bytes": 0}, "min_shard_bytes must be a positive int"),
    ({"table_shards": {"emb": 0}}, "table_shards['emb'] is 0"),
    ({"table_shards": [("emb", 2)]}, "table_shards must be a dict"),
    ({"max_mirrored_bytes": -1}, "max_mirrored_bytes must be an int >= 0"),
])
def test_bad_arguments_say_what_to_do(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as error:
        placement.PlacementPolicy(**kwargs)
    assert message in str(error.value)


def test_gradient_misfit_advice():
    assert placement.gradient_misfit("ps", gradient_is_sparse=True) is None
    assert placement.gradient_misfit("mirrored", gradient_is_sparse=False) is None
    assert "dense gradient" in placement.gradient_misfit("ps", gradient_is_sparse=False)
    assert "sparse" in placement.gradient_misfit("mirrored", gradient_is_sparse=True)


def test_overrides_match_keras_paths_their_tail_and_every_layer_on_the_path():
    policy = placement.PlacementPolicy(
        "hybrid", num_ps=1,
        overrides={"model/features/query/embedding/embeddings": "mirrored",
                   "context": "mirrored", "user_emb/embeddings": "mirrored",
                   "embeddings": "mirrored"})
    kinds = {path: policy.decide(info(path, classes=EMBEDDING)).kind for path in (
        "model/features/query/embedding/embeddings",     # the full path
        "model/features/context/embedding/embeddings",   # a layer on the path
        "recommender/user_emb/embeddings",               # "layer/variable"
        "recommender/item_emb/embeddings")}
    assert kinds == {
        "model/features/query/embedding/embeddings": "mirrored",
        "model/features/context/embedding/embeddings": "mirrored",
        "recommender/user_emb/embeddings": "mirrored",
        "recommender/item_emb/embeddings": "ps"}
    # A variable's own name is no layer name: "embeddings" matched nothing.
    assert policy.unmatched_overrides() == ["embeddings"]


def test_moving_a_mirrored_variable_to_the_ps_unless_pinned():
    policy = placement.PlacementPolicy("hybrid", num_ps=2, overrides={"pinned": "mirrored"},
                                       min_shard_bytes=100)
    bag = info("bag/table", (100, 4))
    assert policy.decide(bag).kind == "mirrored"
    moved = policy.move_to_ps(bag, "read by row")
    assert moved.ps_tasks == (0, 1)
    assert policy.plan["bag/table"].placement == moved
    assert policy.plan["bag/table"].reason == "read by row"
    pinned = info("pinned/table", (100, 4))
    policy.decide(pinned)
    assert policy.move_to_ps(pinned, "read by row") is None
    assert policy.plan["pinned/table"].placement.kind == "mirrored"
    assert policy.move_to_ps(info("scalar/t", ()), "read by row") is None
    allreduce = placement.PlacementPolicy("allreduce", num_ps=2)
    assert allreduce.move_to_ps(bag, "read by row") is None


@pytest.mark.parametrize("shape, described", [((), "() (a scalar)"), (None, "unknown")])
def test_a_ps_override_needs_a_variable_with_rows(shape, described):
    policy = placement.PlacementPolicy("hybrid", num_ps=1, overrides={"*": "ps"})
    with pytest.raises(ValueError) as error:
        policy.decide(info("layer/scale", shape))
    assert f"placement_overrides['*'] = 'ps' matches variable 'layer/scale', whose " \
           f"shape is {described}" in str(error.value)


def test_architecture_ps_keeps_scalars_mirrored():
    policy = placement.PlacementPolicy("ps", num_ps=1)
    assert policy.decide(info("layer/scale", ())).kind == "mirrored"
    assert policy.plan["layer/scale"].reason == "architecture 'ps', but no rows to split"


def test_a_ps_table_with_a_dense_gradient_moves_to_mirrored_unless_it_must_stay():
    policy = placement.PlacementPolicy("hybrid", num_ps=2, overrides={"pinned": "ps"},
                                       max_mirrored_bytes=10_000)
    tied = info("tied/embeddings", (100, 4), EMBEDDING)
    assert policy.decide(tied).ps_tasks == (0,)
    assert policy.stays_on_ps("tied/embeddings", 10_000) is None
    assert policy.stays_on_ps("tied/embeddings", 10_001) == (
        "mirrored, it and its optimizer slots would take 10,001 bytes on each worker, "
        "more than max_mirrored_bytes=10,000")
    policy.move_to_mirrored("tied/embeddings", "dense gradient")
    assert policy.plan["tied/embeddings"].placement == placement.Placement("mirrored")
    assert policy.plan["tied/embeddings"].reason == "dense gradient"
    # Its bytes left task 0, which takes the next table; and it stays mirrored.
    assert policy.decide(info("next/embeddings", (100, 4), EMBEDDING)).ps_tasks == (0,)
    assert policy.move_to_ps(tied, "read by row") is None
    policy.decide(info("pinned/embeddings", (100, 4), EMBEDDING))
    assert policy.stays_on_ps("pinned/embeddings", 1) == (
        "placement_overrides['pinned'] pins it there")
    ps = placement.PlacementPolicy("ps", num_ps=1)
    ps.decide(info("dense/kernel"))
    assert ps.stays_on_ps("dense/kernel", 1) == (
        "architecture 'ps' keeps every layer weight on a PS")


def test_a_newer_variable_of_a_path_keeps_its_record_when_an_older_one_moves():
    """Two models under one strategy: the first model's table moving to mirrored after
    the second one was built frees its own bytes and leaves the second one's record."""
    policy = placement.PlacementPolicy("hybrid", num_ps=2)
    first = policy.decide(info("tied/embeddings", (100, 4), EMBEDDING))
    policy.move_to_mirrored("tied/embeddings", "dense gradient")
    second = policy.decide(info("tied/embeddings", (100, 4), EMBEDDING))
    assert second.ps_tasks == first.ps_tasks == (0,)
    third = policy.decide(info("tied/embeddings", (100, 4), EMBEDDING))
    assert third.ps_tasks == (1,)
    # The second table moves, then the third: the plan shows the third until it moves.
    policy.move_to_mirrored("tied/embeddings", "dense gradient", second, row_bytes=16)
    assert policy.plan["tied/embeddings"].placement is third
    assert policy.decide(info("next/embeddings", (100, 4), EMBEDDING)).ps_tasks == (0,)
    policy.move_to_mirrored("tied/embeddings", "dense gradient", third, row_bytes=16)
    assert policy.plan["tied/embeddings"].placement == placement.Placement("mirrored")
    # A new variable of a moved path is decided afresh, and may move to the PS.
    bag = info("bag/table", (100, 4))
    policy.decide(bag)
    assert policy.move_to_ps(bag, "read by row").kind == "ps"
    policy.move_to_mirrored("bag/table", "dense gradient")
    assert policy.move_to_ps(bag, "read by row") is None
    policy.decide(bag)
    assert policy.move_to_ps(bag, "read by row").kind == "ps"


def test_a_move_is_a_revision_of_an_immutable_plan():
    policy = placement.PlacementPolicy("hybrid", num_ps=2, min_shard_bytes=100)
    bag = info("bag/table", (100, 4))
    policy.decide(bag)
    before = policy.plan
    moved = policy.move_to_ps(bag, "read by row")
    # The plan taken before the move still says what was decided then.
    assert before["bag/table"].placement.kind == "mirrored" and before.revisions == ()
    (revision,) = policy.plan.revisions
    assert (revision.path, revision.before.kind, revision.after, revision.reason) == (
        "bag/table", "mirrored", moved, "read by row")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.plan.records = ()


def test_a_saved_plan_places_its_variables_as_it_says_and_pins_them(tmp_path):
    policy = placement.PlacementPolicy("hybrid", num_ps=3, min_shard_bytes=100)
    policy.decide(info("big/embeddings", (300, 4), EMBEDDING))
    policy.decide(info("tied/embeddings", (100, 4), EMBEDDING))
    policy.move_to_mirrored("tied/embeddings", "dense gradient")
    path = tmp_path / "plan.json"
    policy.plan.save(path)
    loaded = placement.PlacementPlan.load(path)
    assert loaded == policy.plan
    reused = placement.PlacementPolicy("hybrid", num_ps=3, min_shard_bytes=100,
                                       saved=str(path))
    assert (reused.decide(info("big/embeddings", (300, 4), EMBEDDING))
            == policy.plan["big/embeddings"].placement)
    tied = info("tied/embeddings", (100, 4), EMBEDDING)
    assert reused.decide(tied).kind == "mirrored"
    assert reused.plan["tied/embeddings"].reason == "saved plan: dense gradient"
    # Pinned: no move either way.
    assert reused.move_to_ps(tied, "read by row") is None
    assert reused.stays_on_ps("big/embeddings", 1) == (
        "the placement_plan given to the strategy places it there")
    assert reused.plan.revisions == ()
    # A variable the plan does not name is decided by the rules.
    assert reused.decide(info("new/embeddings", (100, 4), EMBEDDING)).kind == "ps"


def test_a_saved_plan_that_does_not_fit_is_refused_with_what_to_do(tmp_path):
    policy = placement.PlacementPolicy("hybrid", num_ps=3, min_shard_bytes=100)
    policy.decide(info("big/embeddings", (300, 4), EMBEDDING))
    with pytest.raises(ValueError, match=r"on ps task 2, but the strategy has 2 PS task"):
        placement.PlacementPolicy("hybrid", num_ps=2, saved=policy.plan)
    reused = placement.PlacementPolicy("hybrid", num_ps=3, saved=policy.plan)
    with pytest.raises(ValueError, match=r"shape 300x4, but the model's has shape 200x4: "
                                         r"save the plan of this model again"):
        reused.decide(info("big/embeddings", (200, 4), EMBEDDING))
    with pytest.raises(TypeError, match="placement_plan must be a PlacementPlan"):
        placement.PlacementPolicy("hybrid", num_ps=3, saved={"big/embeddings": "ps"})
    (tmp_path / "other.json").write_text('{"layers": []}')
    with pytest.raises(ValueError, match="not a saved placement plan"):
        placement.PlacementPolicy("hybrid", num_ps=3, saved=tmp_path / "other.json")
