"""cohort.agent_meshes (placement, mesh sizes, processes) and optim's opt-state placement (moments like params)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from config_files import load_config
from corl_jax.cohort import agent_meshes
from corl_jax.models import Decoder, ModelConfig
from corl_jax.models.sharding import make_mesh, state_shardings
from corl_jax.optim import init_opt_state, make_optimizer, opt_state_shardings

TINY = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def _config(mesh, agents=3):
    config = load_config("ring3")
    config.mesh.update(data=-1, fsdp=1, tensor=1)
    config.mesh.update(mesh)
    assert len(config.agents) == agents
    return config


@pytest.mark.parametrize("count, placement, mesh, shape, disjoint", [
    (8, "shared", dict(data=-1, fsdp=2, tensor=2), dict(data=2, fsdp=2, tensor=2), False),
    (8, "shared", dict(data=1, fsdp=4), dict(data=1, fsdp=4, tensor=1), False),
    (6, "partitioned", dict(data=-1, fsdp=2), dict(data=1, fsdp=2, tensor=1), True),
])
def test_agent_meshes_cover_the_placement(count, placement, mesh, shape, disjoint):
    devices = jax.devices()[:count]
    meshes = agent_meshes(_config(mesh), devices, placement)
    assert [dict(m.shape) for m in meshes] == [shape] * 3
    sets = [set(m.devices.flat) for m in meshes]
    if disjoint:
        assert set.union(*sets) == set(devices) and sum(map(len, sets)) == len(devices)
    else:
        assert all(s == sets[0] for s in sets)


def _fake_devices(per_process, processes):
    return [SimpleNamespace(id=p * per_process + i, process_index=p)
            for p in range(processes) for i in range(per_process)]


@pytest.mark.parametrize("devices, placement, mesh, message", [
    (8, "partitioned", {}, r"splits 8 chips among 3 agents: needs a multiple .*Fix: --config.placement=shared"),
    (8, "shared", {"fsdp": 3}, r"mesh data=-1 fsdp=3 tensor=1 does not fit the 8 chips .*Fix: --config.mesh"),
    (8, "shared", {"data": 3}, r"mesh data=3 fsdp=1 tensor=1 does not fit the 8 chips .*dividing 8"),
    (8, "everywhere", {}, r"unknown placement 'everywhere'. Fix: --config.placement"),
    (_fake_devices(4, 2), "partitioned", {}, r"splits the \[4, 4\] chips of 2 processes among 3 agents"),
    (_fake_devices(4, 2), "shared", {"data": 2, "fsdp": 2}, r"uses no device of process\(es\) \[1\].*data=-1"),
])
def test_bad_meshes_and_placements_are_one_line_errors(devices, placement, mesh, message):
    devices = jax.devices()[:devices] if isinstance(devices, int) else devices
    with pytest.raises(ValueError, match=message) as error:
        agent_meshes(_config(mesh), devices, placement)
    assert "\n" not in str(error.value)


def test_a_mesh_over_every_process_passes_the_process_check(monkeypatch):
    """Two processes of 4 devices each: partitioned gives every agent devices of both (make_mesh replaced: the
    devices are stand-ins)."""
    monkeypatch.setattr("corl_jax.cohort.make_mesh", lambda devices, **axes: (axes, devices))
    config = _config({}, agents=3)
    config.agents = {k: config.agents[k] for k in list(config.agents)[:2]}
    meshes = agent_meshes(config, _fake_devices(4, 2), "partitioned")
    for axes, devices in meshes:
        assert axes == dict(data=4, fsdp=1, tensor=1) and {d.process_index for d in devices} == {0, 1}
    assert not {d.id for d in meshes[0][1]} & {d.id for d in meshes[1][1]}


def _params(mesh=None):
    params = nnx.split(Decoder(ModelConfig.from_hf_dict(TINY), rngs=nnx.Rngs(0)))[1]
    return params if mesh is None else jax.device_put(params, state_shardings(params, mesh))


def test_adamw_moments_are_sharded_like_their_parameters_and_step_like_the_default():
    mesh = make_mesh(fsdp=8)
    params = _params(mesh)
    optimizer = make_optimizer(1e-2, 10, warmup_ratio=0.0)
    state = init_opt_state(optimizer, params, mesh)
    adam = state[1][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    param_shardings = [x.sharding for x in jax.tree.leaves(params)]
    assert any(s.spec != jax.sharding.PartitionSpec(*[None] * len(s.spec)) for s in param_shardings)  # fsdp used
    for moments in (adam.mu, adam.nu):
        assert [x.sharding for x in jax.tree.leaves(moments)] == param_shardings
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert adam.count.sharding == replicated and adam.count.committed
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    assert jax.tree.leaves(opt_state_shardings(optimizer, abstract, mesh)) == [x.sharding for x in
                                                                               jax.tree.leaves(state)]

    @jax.jit
    def step(params, state):
        grads = jax.tree.map(lambda p: jnp.sin(p) + 0.1, params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    sharded = step(*step(params, state))
    plain_params = _params()
    default = step(*step(plain_params, optimizer.init(plain_params)))
    for x, y in zip(jax.tree.leaves(sharded), jax.tree.leaves(default)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    for x, s in zip(jax.tree.leaves(sharded[1][1][0].mu), param_shardings):  # the step keeps the layout
        assert x.sharding.is_equivalent_to(s, x.ndim)


def test_placed_puts_every_leaf_on_its_sharding_unchanged():
    """`cohort._placed` (the update's outputs back on the parameters' shardings, one program on every process):
    leaves arrive on other shardings (replicated, another axis) and leave on the given ones, values untouched."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from corl_jax.cohort import _placed

    mesh = make_mesh(data=2, fsdp=4)
    want = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P("data"))}
    have = {"w": NamedSharding(mesh, P()), "b": NamedSharding(mesh, P(None))}
    values = {"w": np.arange(32.0).reshape(8, 4), "b": np.arange(4.0)}
    tree = {k: jax.device_put(v, have[k]) for k, v in values.items()}
    placed = _placed(tree, want)
    for k in values:
        assert placed[k].sharding == want[k]
        np.testing.assert_array_equal(np.asarray(placed[k]), values[k])


def test_leafwise_equals_tree_map_on_every_leaf_sharding():
    """`cohort._leafwise` (the update's zero gradients, the KL reference's copy) equals `jax.tree.map` leaf for leaf,
    on each leaf's own sharding, and the copy owns its buffers (the update donates the parameters')."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from corl_jax.cohort import _leafwise

    mesh = make_mesh(data=2, fsdp=4)
    shardings = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P("data")),
                 "s": NamedSharding(mesh, P())}
    values = {"w": np.arange(32.0, dtype=np.float32).reshape(8, 4), "b": np.arange(4, dtype=np.int32),
              "s": np.float32(3.0)}
    tree = {k: jax.device_put(v, shardings[k]) for k, v in values.items()}
    for fn in (jnp.zeros_like, jnp.copy):
        out = _leafwise(fn, tree)
        for k, v in values.items():
            assert out[k].sharding == shardings[k] and out[k].dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(fn(v)))
    copy = _leafwise(jnp.copy, tree)
    jax.tree.map(lambda x: x.delete(), tree)
    np.testing.assert_array_equal(np.asarray(copy["w"]), values["w"])
