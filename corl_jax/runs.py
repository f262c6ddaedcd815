"""A run's workdir read back (finished or ongoing): its config, agents, checkpoint steps, each agent's eval history
and own best step, step resolution, and one agent's trained weights as a `Policy`.

Steps are resolved per agent: `"best"` is the agent's own best evaluated step (the first strictly greatest eval
accuracy, the reference's BestKeeper rule), `"latest"` the newest checkpoint, an integer that step. Step 0 is the
base model (`model_path`; the trainer saves no checkpoint there), so an agent that no evaluated step improved on
resolves `"best"` to its base weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from corl_jax.checkpointing import Checkpointer
from corl_jax.models import Decoder, ModelConfig, Policy
from corl_jax.models.sharding import DEFAULT_RULES, variable_sharding


class RunError(ValueError):
    """A workdir, step or agent that cannot be used; the message is one line that names the fix."""


@dataclasses.dataclass
class EvalHistory:
    """Per agent: accuracy at each evaluated step; the best is the first strictly greatest (the reference's keeper)."""

    by_agent: dict[str, dict[int, float]]

    def add(self, step: int, accuracies: dict[str, float]) -> None:
        for name, acc in accuracies.items():
            self.by_agent.setdefault(name, {})[step] = acc

    def best_step(self, agent: str) -> int | None:
        """The agent's first step of greatest accuracy; None when it was never evaluated."""
        history = self.by_agent.get(agent, {})
        return max(sorted(history), key=lambda s: history[s]) if history else None  # max keeps the first of equals

    def summary(self) -> dict[str, dict[str, float | int | bool | None]]:
        """Per agent: initial/final/best accuracy and best step; `best_is_base` when no step beat step 0."""
        out = {}
        for name, history in self.by_agent.items():
            steps = sorted(history)
            best = self.best_step(name)
            out[name] = {"initial_accuracy": history[steps[0]], "final_accuracy": history[steps[-1]],
                         "best_accuracy": history[best], "best_step": best, "best_is_base": best == 0}
        return out

    def to_json(self) -> dict[str, dict[str, float]]:
        return {name: {str(s): v for s, v in h.items()} for name, h in self.by_agent.items()}

    @classmethod
    def from_json(cls, data: dict[str, dict[str, float]]) -> EvalHistory:
        return cls({name: {int(s): v for s, v in h.items()} for name, h in data.items()})


@dataclasses.dataclass(frozen=True)
class Run:
    """What a workdir holds; `open_run(workdir)` reads it."""

    workdir: str
    config: ml_collections.ConfigDict   # the run's config.json
    agents: tuple[str, ...]             # in the config's order (the ring order)
    steps: tuple[int, ...]              # checkpoint steps on disk
    history: EvalHistory                # as of the latest checkpoint

    def check_agent(self, agent: str) -> None:
        if agent not in self.agents:
            raise RunError(f"agent {agent!r} is not in the run {self.workdir} (its agents: {', '.join(self.agents)})")

    def best_step(self, agent: str) -> int | None:
        """The agent's own best evaluated step (0: no step beat the base model); None: never evaluated."""
        self.check_agent(agent)
        return self.history.best_step(agent)

    def resolve_step(self, agent: str, step: str | int = "best") -> int:
        """`"best"`, `"latest"` or a step number (int or digits) -> a step with weights (0 = the base model)."""
        self.check_agent(agent)
        where = f"{self.workdir}/checkpoints"
        if isinstance(step, str) and step.isdigit():
            step = int(step)
        if step not in ("best", "latest") and not isinstance(step, int):
            raise RunError(f"step {step!r} is not understood; use best, latest or a step number")
        if step == 0:
            return 0
        if not self.steps:
            raise RunError(f"the run {self.workdir} has no checkpoints yet (none in {where}); train it further, "
                           "or use step 0 for the base model")
        if step == "latest":
            return self.steps[-1]
        if step == "best":
            best = self.best_step(agent)
            if best is None:
                raise RunError(f"agent {agent!r} of {self.workdir} was never evaluated, so it has no best step; "
                               f"use latest or one of the steps {list(self.steps)}")
            step = best
        if step != 0 and step not in self.steps:
            raise RunError(f"no checkpoint of step {step} for agent {agent!r} in {where} (steps there: "
                           f"{list(self.steps)}); use one of them, latest, or 0 for the base model")
        return step

    def model_path(self, agent: str) -> str:
        """The local HF directory of the agent's base model (`tiny:`/`demo:` paths built on first use)."""
        from corl_jax.registry import resolve_model_paths

        self.check_agent(agent)
        return resolve_model_paths([self.config.agents[agent].model_path])[0]


def open_run(workdir: str | os.PathLike) -> Run:
    """Read `workdir`'s config.json, checkpoint steps and eval history (RunError when it is not a run)."""
    workdir = os.path.abspath(workdir)
    config_file = Path(workdir) / "config.json"
    if not config_file.is_file():
        raise RunError(f"{workdir} has no config.json, so it is not a corl_jax run directory; pass the --workdir "
                       "that corl_jax.train wrote")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{config_file} is not valid JSON ({e}); restore it from the run's launch config") from None
    if not raw.get("agents"):
        raise RunError(f"{config_file} names no agents; it is not a corl_jax run config")
    steps, history = (), EvalHistory({})
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        with Checkpointer(workdir) as checkpointer:
            steps = tuple(checkpointer.all_steps())
            if steps:
                meta = checkpointer.read_meta(steps[-1])["metadata"]
                history = EvalHistory.from_json(meta.get("eval_history", {}))
    return Run(workdir=workdir, config=ml_collections.ConfigDict(raw), agents=tuple(raw["agents"]), steps=steps,
               history=history)


def load_agent(workdir: str | os.PathLike, agent: str, step: str | int = "best", *, dtype=jnp.float32,
               mesh: Mesh | None = None) -> tuple[Policy, int]:
    """One agent's weights at `step` ("best" | "latest" | N; 0 = base) as a Policy in `dtype` (parameters and
    compute), with the agent's tokenizer (its training chat template included) and generation config.

    Only that agent's parameters are read from the checkpoint (no optimiser state, no other agent), directly in
    `dtype` and, with `mesh`, in their sharding. Returns (policy, resolved step)."""
    from corl_jax.stand_ins import load_policy
    from corl_jax.tokenization import load_tokenizer

    run = open_run(workdir)
    resolved = run.resolve_step(agent, step)
    path = run.model_path(agent)
    base = load_policy(path, dtype=dtype, mesh=mesh) if resolved == 0 else None
    if base is None:
        config = ModelConfig.from_hf_dict(json.loads((Path(path) / "config.json").read_text()),
                                          param_dtype=dtype, dtype=dtype)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
        _check_matches(run, agent, resolved, abstract, path)
        one_device = SingleDeviceSharding(jax.devices()[0])
        for _, variable in nnx.to_flat_state(abstract):
            sharding = one_device if mesh is None else variable_sharding(variable, mesh, DEFAULT_RULES)
            variable.set_value(jax.ShapeDtypeStruct(variable.shape, dtype, sharding=sharding))
        with Checkpointer(run.workdir) as checkpointer:
            params = checkpointer.restore_subtree(resolved, {agent: {"params": abstract}})[agent]["params"]
        generation_file = Path(path) / "generation_config.json"
        base = Policy(config=config, model=nnx.merge(graphdef, params), tokenizer=None, mesh=mesh,
                      generation_config=json.loads(generation_file.read_text()) if generation_file.is_file() else {})
    template = run.config.agents[agent].get("chat_template") or None
    return dataclasses.replace(base, tokenizer=load_tokenizer(path, chat_template=template)), resolved


def _check_matches(run: Run, agent: str, step: int, abstract, model_path: str) -> None:
    """The checkpoint holds `agent`'s parameters with the shapes its config's model implies."""
    with Checkpointer(run.workdir) as checkpointer:
        saved = checkpointer.state_metadata(step)
    where = f"checkpoint step {step} of {run.workdir}"
    fix = "the checkpoints come from another config; point --workdir at the run that wrote them"
    if agent not in saved or "params" not in saved[agent]:
        raise RunError(f"{where} holds no parameters of agent {agent!r} (it holds {sorted(saved)}): {fix}")
    shapes = {_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved[agent]["params"])}
    for p, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        name = _name(p)
        if shapes.get(name) != tuple(leaf.shape):
            raise RunError(f"{where}: agent {agent!r}'s parameter {name} has shape {shapes.get(name)} but its "
                           f"model {model_path} implies {tuple(leaf.shape)}: {fix}")


def _name(path) -> str:
    """'layers.q_proj.value' for a key path through dicts (the saved tree) or NNX states and variables."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
