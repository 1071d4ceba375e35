"""ShardPlan: disjoint, complete shards; equal steps on every rank; the same global batches at any world size."""
import numpy as np
import pytest

from hvdtrain.data.sharding import ShardPlan, eval_shard

CASES = [(60000, 2, 128), (1000, 3, 7), (5, 4, 2), (10, 3, 4), (257, 2, 64), (962, 3, 64), (1, 1, 1), (7, 8, 1)]


@pytest.mark.parametrize("n, world_size, batch", CASES)
def test_shards_are_disjoint_complete_with_equal_steps(n, world_size, batch):
    plans = [ShardPlan(n, batch, world_size, r, seed=4) for r in range(world_size)]
    full, rest = divmod(n, world_size * batch)
    folds = 0 < rest < world_size and full >= 1  # too few for every rank: they join the step before
    for epoch in (0, 1):
        per_rank = [list(p.epoch(epoch)) for p in plans]
        steps = {len(s) for s in per_rank}
        assert steps == {plans[0].steps_per_epoch}
        assert plans[0].steps_per_epoch == -(-n // (world_size * batch)) - folds
        shards = [np.concatenate([idx for _, idx, _ in s]) for s in per_rank]
        everything = np.concatenate(shards)
        assert len(everything) == n and set(everything.tolist()) == set(range(n)), "disjoint and complete"
        for s in per_rank:
            assert all(len(idx) <= batch + folds for _, idx, _ in s)
            assert all(len(idx) >= 1 for _, idx, _ in s) or n < world_size, "an empty local batch"
            assert all(g == sum(len(other[i][1]) for other in per_rank) for i, (_, _, g) in enumerate(s))
        if folds:
            assert per_rank[0][-1][2] == world_size * batch + rest


def test_a_rank_never_gets_an_empty_batch_when_every_rank_can_have_one():
    """257 examples at 2 ranks x 64: the last example joins the step before, as 65 + 64."""
    plans = [ShardPlan(257, 64, 2, r, seed=0) for r in range(2)]
    assert plans[0].steps_per_epoch == 2
    assert [len(idx) for _, idx, _ in plans[0].epoch(0)] == [64, 64]
    assert [len(idx) for _, idx, _ in plans[1].epoch(0)] == [64, 65]
    assert plans[0].global_batch_size(1) == 129 and plans[0].examples_before(2) == 257


def test_epochs_reshuffle_and_seed_fixes_the_order():
    a, b = ShardPlan(100, 10, 2, 0, seed=1), ShardPlan(100, 10, 2, 0, seed=1)
    assert np.array_equal(a.permutation(0), b.permutation(0))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), ShardPlan(100, 10, 2, 0, seed=2).permutation(0))


def test_global_batches_do_not_depend_on_world_size():
    """Step s over all ranks holds the examples one process with the global batch takes at step s."""
    single = list(ShardPlan(103, 20, 1, 0, seed=9).epoch(3))
    ranks = [list(ShardPlan(103, 10, 2, r, seed=9).epoch(3)) for r in range(2)]
    for step, idx, global_count in single:
        together = np.concatenate([ranks[0][step][1], ranks[1][step][1]])
        assert np.array_equal(together, idx) and global_count == len(idx)


@pytest.mark.parametrize("n, before, after, batch, steps_before", [(103, 2, 3, 10, 3), (103, 3, 1, 10, 2),
                                                                   (50, 1, 2, 7, 7), (20, 2, 4, 3, 0),
                                                                   (100, 1, 3, 10, 2), (100, 1, 5, 3, 4)])
def test_resizing_mid_epoch_covers_the_rest_once(n, before, after, batch, steps_before):
    """An elastic resize: the new world size continues at the old position, without repeats or gaps,
    and gives no rank an empty batch: a first step with fewer examples than ranks joins the next,
    and if there is none, those last examples (fewer than the ranks) sit the epoch out."""
    old = [ShardPlan(n, batch, before, r, seed=5) for r in range(before)]
    done = [idx for p in old for step, idx, _ in p.epoch(1) if step < steps_before]
    position = old[0].examples_before(steps_before)
    new = [ShardPlan(n, batch, after, r, seed=5) for r in range(after)]
    rest = [list(p.epoch(1, first_example=position)) for p in new]
    # Trainer.fit asks for the start step first and passes it back: the same steps must come.
    as_fit = [list(p.epoch(1, p.start_step(0, position), position)) for p in new]
    assert [[(s, idx.tolist(), g) for s, idx, g in steps] for steps in as_fit] == \
        [[(s, idx.tolist(), g) for s, idx, g in steps] for steps in rest]
    assert len({len(steps) for steps in rest}) == 1, "every rank runs the same number of steps"
    for i, (step, _, global_count) in enumerate(rest[0]):
        assert global_count == sum(len(steps[i][1]) for steps in rest)
        assert global_count == new[0].global_batch_size(step, first_example=position)
        assert all(len(steps[i][1]) >= 1 for steps in rest), "an empty local batch"
    taken = np.concatenate(done + [idx for steps in rest for _, idx, _ in steps])
    assert len(set(taken.tolist())) == len(taken), "an example twice"
    left_out = n - len(taken)
    assert left_out == (n - position if not rest[0] and 0 < n - position < after else 0)
    if rest[0] and position % new[0].global_batch:
        step, _, global_count = rest[0][0]
        short = min(n, position - position % new[0].global_batch + new[0].global_batch) - position
        assert step == position // new[0].global_batch + (short < after), "too short a first step joins the next"
        assert global_count == new[0].examples_before(step + 1) - position, "the first step re-aligns the batches"


def test_eval_shards_cover_each_example_once():
    for n, world_size in [(10000, 2), (1001, 3), (2, 4)]:
        covered = np.concatenate([np.arange(n)[eval_shard(n, world_size, r)] for r in range(world_size)])
        assert np.array_equal(covered, np.arange(n))


@pytest.mark.parametrize("args", [(0, 1, 1, 0), (10, 0, 1, 0), (10, 1, 0, 0), (10, 1, 2, 2)])
def test_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        ShardPlan(*args)
