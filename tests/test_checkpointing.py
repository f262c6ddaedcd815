"""Orbax checkpoints: exact round trip, retention of the last N plus the best, damaged or corrupted steps (checksums,
non-finite states), resharding."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from corl_jax.checkpointing import Checkpointer, CheckpointError, NonFiniteStateError, Snapshot
from corl_jax.data import Problem, PromptStream


def train_state():
    """Two agents' parameters and AdamW states after one update (non-zero moments)."""
    optimizer = optax.adamw(1e-2)
    state = {}
    for seed, name in enumerate(("qwen", "llama")):
        params = {"w": jax.random.normal(jax.random.key(seed), (4, 3)), "b": jnp.arange(3.0)}
        opt_state = optimizer.init(params)
        grads = jax.tree.map(jnp.ones_like, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        state[name] = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
    return optimizer, state


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def snapshot(step, state=None, metric=None):
    return Snapshot(step=step, state=state if state is not None else {"x": jnp.full((2,), float(step))},
                    data_state={"position": step}, rng={}, metric=metric)


def test_round_trip_is_exact(tmp_path):
    optimizer, state = train_state()
    problems = [Problem(id=i, text=f"p{i}", answer=None, source="mem") for i in range(7)]
    stream = PromptStream(problems, 2, seed=5)
    next(stream), next(stream)
    rng = {"qwen": jax.random.split(jax.random.key(1))[1], "legacy": jax.random.PRNGKey(9),
           "rbg": jax.random.key(2, impl="rbg")}
    with Checkpointer(str(tmp_path), keep_last=2) as checkpointer:
        assert checkpointer.latest_step() is None
        checkpointer.save(Snapshot(step=7, state=state, data_state=stream.get_state(), rng=rng,
                                   metadata={"config_hash": "abc"}, metric=0.25))
        checkpointer.wait()
    with Checkpointer(str(tmp_path), keep_last=2) as checkpointer:  # a fresh process's view of the workdir
        restored = checkpointer.restore(state_target=abstract(state))
    assert restored.step == 7 and restored.metric == 0.25 and restored.metadata == {"config_hash": "abc"}
    assert jax.tree.structure(restored.state) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, restored.state, state)
    for name, key in rng.items():
        assert restored.rng[name].dtype == key.dtype
        np.testing.assert_array_equal(jax.random.uniform(restored.rng[name], (3,)), jax.random.uniform(key, (3,)))
    resumed = PromptStream(problems, 2, seed=5)
    resumed.set_state(restored.data_state)
    assert next(resumed).ids == next(stream).ids
    # the restored optimiser state continues training exactly like the original
    grads = jax.tree.map(jnp.ones_like, state["qwen"]["params"])
    original = optimizer.update(grads, state["qwen"]["opt_state"], state["qwen"]["params"])
    again = optimizer.update(grads, restored.state["qwen"]["opt_state"], restored.state["qwen"]["params"])
    jax.tree.map(np.testing.assert_array_equal, again, original)


def test_keeps_the_last_n_plus_the_best_across_restarts(tmp_path):
    metrics = {1: 0.5, 2: None, 3: 0.7, 4: None, 5: 0.7, 6: None}
    with Checkpointer(str(tmp_path), keep_last=2) as checkpointer:
        for step, metric in metrics.items():
            checkpointer.save(snapshot(step, metric=metric))
        checkpointer.wait()
        assert checkpointer.all_steps() == [3, 5, 6]  # 3: the earliest of the equal bests
    with Checkpointer(str(tmp_path), keep_last=2) as checkpointer:
        for step in (7, 8):
            checkpointer.save(snapshot(step))
        checkpointer.save(snapshot(9, metric=0.6))
        checkpointer.wait()
        assert checkpointer.all_steps() == [3, 8, 9]
        assert sorted(os.listdir(checkpointer.directory)) == ["3", "8", "9"]
    with Checkpointer(str(tmp_path / "plain"), keep_last=1, keep_best=False) as checkpointer:
        for step, metric in metrics.items():
            checkpointer.save(snapshot(step, metric=metric))
        checkpointer.wait()
        assert checkpointer.all_steps() == [6]


def test_keeps_every_keys_best_step(tmp_path):
    """Per-agent metrics: each agent's own best step survives keep_last, even when the mean would drop it."""
    metrics = {1: {"a": 0.2, "b": 0.9}, 2: {"a": 0.6, "b": 0.1}, 3: {"a": 0.6, "b": 0.5}, 4: None,
               5: {"a": 0.4, "b": 0.4}, 6: None}
    with Checkpointer(str(tmp_path), keep_last=1) as checkpointer:
        for step, metric in metrics.items():
            checkpointer.save(snapshot(step, metric=metric))
        checkpointer.wait()
        assert checkpointer.all_steps() == [1, 2, 6]  # a's best 2 (not its tie at 3), b's best 1, the latest
    with Checkpointer(str(tmp_path), keep_last=1) as checkpointer:  # a restart keeps them too
        checkpointer.save(snapshot(7, metric={"a": 0.7, "b": 0.0}))
        checkpointer.wait()
        assert checkpointer.all_steps() == [1, 7]  # a's new best 7 replaces 2
        assert checkpointer.read_meta(7)["metric"] == {"a": 0.7, "b": 0.0}
    with pytest.raises(ValueError, match="not finite"):
        Checkpointer(str(tmp_path / "nan")).save(snapshot(1, metric={"a": float("nan")}))


def test_restore_subtree_reads_only_the_named_part(tmp_path):
    _, state = train_state()
    with Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(Snapshot(step=1, state=state, data_state={}, rng={}))
        checkpointer.wait()
        shapes = jax.tree.map(lambda m: m.shape, checkpointer.state_metadata(1))
        assert shapes["llama"]["params"] == {"w": (4, 3), "b": (3,)}
        target = {"llama": {"params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), state["llama"]["params"])}}
        restored = checkpointer.restore_subtree(1, target)
    assert set(restored) == {"llama"} and set(restored["llama"]) == {"params"}
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state["llama"]["params"]), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))


def test_damaged_checkpoint_is_reported_and_never_deleted(tmp_path):
    with Checkpointer(str(tmp_path), keep_last=3) as checkpointer:
        for step in (1, 2):
            checkpointer.save(snapshot(step))
        checkpointer.wait()
        damaged = checkpointer.step_dir(2)
    with open(os.path.join(damaged, "data", "metadata"), "w") as f:
        f.write("{truncated")
    with Checkpointer(str(tmp_path), keep_last=3) as checkpointer:
        with pytest.raises(CheckpointError) as error:
            checkpointer.restore()
        message = str(error.value)
        assert damaged in message and "JSONDecodeError" in message and "\n" not in message
        assert "restart=True" in message and "fallback_to_previous=True" in message
        assert checkpointer.all_steps() == [1, 2]  # nothing changed without the fallback
        assert checkpointer.restore(fallback_to_previous=True).step == 1
        assert checkpointer.all_steps() == [1] and list(checkpointer.rejected) == [2] and not os.path.exists(damaged)
        (moved,) = os.listdir(tmp_path / "rejected_checkpoints")  # set aside, never deleted
        assert moved.startswith("2-") and os.path.isfile(tmp_path / "rejected_checkpoints" / moved / "data" / "metadata")
        checkpointer.save(snapshot(2))  # the run redoes the step
        checkpointer.wait()
        assert checkpointer.restore().step == 2
        with pytest.raises(CheckpointError, match="no checkpoint of step 5"):
            checkpointer.restore(5)


def test_silently_changed_array_data_fails_its_checksum(tmp_path):
    """Array files that tensorstore reads without complaint but that are not what was saved (here: step 1's data
    under step 2's metadata) are caught by the fingerprints, and with the fallback the older step is restored."""
    _, state = train_state()
    with Checkpointer(str(tmp_path), keep_last=3) as checkpointer:
        checkpointer.save(snapshot(1, state=state))
        checkpointer.save(snapshot(2, state=jax.tree.map(lambda x: x + 1, state)))
        checkpointer.wait()
        shutil.rmtree(os.path.join(checkpointer.step_dir(2), "state"))
        shutil.copytree(os.path.join(checkpointer.step_dir(1), "state"), os.path.join(checkpointer.step_dir(2), "state"))
    with Checkpointer(str(tmp_path), keep_last=3) as checkpointer:
        with pytest.raises(CheckpointError, match="checkpoints/2: CheckpointError: array .* does not match its checksum"):
            checkpointer.restore(state_target=abstract(state))
        restored = checkpointer.restore(state_target=abstract(state), fallback_to_previous=True)
    assert restored.step == 1 and checkpointer.rejected.keys() == {2}
    jax.tree.map(np.testing.assert_array_equal, restored.state, state)


def test_nonfinite_state_is_never_saved_nor_restored(tmp_path):
    _, state = train_state()
    poisoned = jax.tree.map(lambda x: x, state)
    poisoned["llama"]["params"]["w"] = poisoned["llama"]["params"]["w"].at[1, 2].set(jnp.inf)
    with Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(snapshot(1, state=state))
        with pytest.raises(NonFiniteStateError, match="llama/params/w"):
            checkpointer.save(snapshot(2, state=poisoned, metric=1.0))
        checkpointer.wait()
        assert checkpointer.all_steps() == [1] and sorted(os.listdir(checkpointer.directory)) == ["1"]  # no trace
        # a checkpoint written without fingerprints (an older version of this module) still gets the finiteness check
        checkpointer._manager.save(3, args=ocp.args.Composite(
            state=ocp.args.StandardSave(poisoned), data=ocp.args.JsonSave({}), rng=ocp.args.JsonSave({}),
            meta=ocp.args.JsonSave({"step": 3, "metric": None, "metadata": {}})))
        checkpointer.wait()
        with pytest.raises(CheckpointError, match="llama/params/w holds NaN or inf"):
            checkpointer.restore(3)
        assert checkpointer.restore(fallback_to_previous=True).step == 1


def test_an_interrupted_save_is_ignored_and_redone(tmp_path):
    with Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(snapshot(1))
        checkpointer.wait()
        shutil.copytree(checkpointer.step_dir(1), checkpointer.step_dir(2) + ".orbax-checkpoint-tmp")
        os.remove(os.path.join(checkpointer.step_dir(2) + ".orbax-checkpoint-tmp", "commit_success.txt"))
    with Checkpointer(str(tmp_path)) as checkpointer:  # the run was killed while writing step 2
        assert checkpointer.latest_step() == 1
        checkpointer.save(snapshot(2))
        checkpointer.wait()
        restored = checkpointer.restore()
    assert restored.step == 2 and json.loads(json.dumps(restored.data_state)) == {"position": 2}
    np.testing.assert_array_equal(restored.state["x"], [2.0, 2.0])


def test_restore_reshards_into_the_target_layout(tmp_path):
    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices that tests/conftest.py sets up")
    saved_mesh = jax.make_mesh((8,), ("data",))
    weights = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(saved_mesh, PartitionSpec("data")))
    with Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(Snapshot(step=1, state={"w": weights}, data_state={}, rng={}))
        checkpointer.wait()
        target_mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
        target = NamedSharding(target_mesh, PartitionSpec(None, "tensor"))
        restored = checkpointer.restore(state_target={"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
                                                                              sharding=target)})
    assert restored.state["w"].sharding == target
    np.testing.assert_array_equal(restored.state["w"], weights)
