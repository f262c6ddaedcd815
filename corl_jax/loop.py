"""The training loop: data, in-loop evaluation, checkpoints and metrics around `Cohort.step`."""

from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from tqdm import tqdm

from corl_jax import multihost
from corl_jax.checkpointing import Checkpointer, Snapshot
from corl_jax.cohort import Cohort, load_agents
from corl_jax.data import PromptStream, load_train_and_eval
from corl_jax.metrics import RunLog, write_json


@dataclasses.dataclass
class EvalHistory:
    """Per agent: accuracy at each evaluated step; the best is the first strictly greatest (the reference's keeper)."""

    by_agent: dict[str, dict[int, float]]

    def add(self, step: int, accuracies: dict[str, float]) -> None:
        for name, acc in accuracies.items():
            self.by_agent.setdefault(name, {})[step] = acc

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        out = {}
        for name, history in self.by_agent.items():
            steps = sorted(history)
            best = max(steps, key=lambda s: (history[s], -s)) if steps else None
            out[name] = {"initial_accuracy": history[steps[0]] if steps else None,
                         "final_accuracy": history[steps[-1]] if steps else None,
                         "best_accuracy": history[best] if steps else None, "best_step": best}
        return out


def evaluate(cohort: Cohort, problems, step: int) -> dict[str, float]:
    """Ground-truth accuracy per agent: the mean over `train.eval_samples_per_prompt` samples per prompt (the
    reference: 1) at `train.eval_temperature` (the reference: 0.6), graded against the gold answer with the method's
    grader, or for code by the problem's tests (pass@1) (§1.12, §6.1). More samples per prompt shrink the sampling
    noise of a before/after comparison."""
    t = cohort.config.train
    k = t.eval_samples_per_prompt
    counts = {}
    for agent in cohort.agents:
        correct = 0
        for start in range(0, len(problems), t.eval_batch_prompts):
            chunk = problems[start:start + t.eval_batch_prompts]
            key = jax.random.fold_in(agent.step_key(step, 2), start)
            texts = [getattr(p, agent.text_field) or p.text for p in chunk]
            rollouts = cohort.finish(agent, cohort.sample(agent, texts, key, num_samples=k,
                                                          max_new_tokens=t.eval_max_new_tokens,
                                                          temperature=t.eval_temperature))
            if multihost.is_main():  # grading is time-bounded: process 0 grades, every process gets its count
                correct += sum(cohort.task.eval_correct(  # prompt-major: row p*k + j
                    rollouts.texts, [chunk[i // k] for i in range(len(rollouts.texts))]))
        counts[agent.name] = correct
    correct = multihost.broadcast(np.array(list(counts.values()), np.int32))
    return {name: int(c) / (len(problems) * k) for name, c in zip(counts, correct)}


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Train (or resume) the run of `config` in `workdir`; returns the summary written to summary.json."""
    workdir = epath.Path(workdir)
    if multihost.is_main():
        workdir.mkdir(parents=True, exist_ok=True)
    train_problems, eval_problems = load_train_and_eval(
        config.data, train_needs_answers=config.method == "gt_reward")
    stream = PromptStream(train_problems, config.rollout.prompts_per_step, config.data_seed)
    total_steps = config.train.max_steps
    cohort = Cohort(config, load_agents(config, total_steps))
    # Synchronous saves: the next update donates the parameter buffers that a pending async save would still read.
    checkpointer = Checkpointer(workdir, keep_last=config.train.keep_last, async_save=False)
    history = EvalHistory({})
    nonfinite = {a.name: 0 for a in cohort.agents}
    start = 0
    latest = checkpointer.latest_step() if config.train.resume else None
    if latest is not None:
        start, history, nonfinite = _restore(checkpointer, cohort, stream, latest)
        logging.info("resumed from step %d of %s", start, workdir)
    main = multihost.is_main()  # one process writes the run's files and prints; all of them save checkpoints
    if main:
        _write_config(config, workdir)
    log = RunLog(workdir, resume_step=start, active=main)

    def maybe_eval(step: int) -> dict[str, float] | None:
        t = config.train
        due = (step == 0 and t.eval_on_start) or (step > 0 and step % t.eval_every == 0) or step == total_steps
        if not due or not eval_problems or step in next(iter(history.by_agent.values()), {}):
            return None
        accuracies = evaluate(cohort, eval_problems, step)
        history.add(step, accuracies)
        log.scalars(step, {f"{name}/eval_reward": acc for name, acc in accuracies.items()})
        _print(f"step {step}: eval accuracy " + ", ".join(f"{n} {a:.3f}" for n, a in accuracies.items()))
        return accuracies

    if start == 0:
        maybe_eval(0)
    bar = tqdm(total=total_steps, initial=start, desc="co-rl" if config.method == "co_rl" else config.method,
               dynamic_ncols=True, disable=not main)
    for step in range(start + 1, total_steps + 1):
        t0 = time.perf_counter()
        block = next(stream)
        metrics, records = cohort.step(block, step)
        for name, m in metrics.items():
            nonfinite[name] += int(m["skipped"])
        _check_nonfinite(nonfinite, config.train.max_nonfinite_updates, step)
        flat = {f"{name}/{k}": v for name, m in metrics.items() for k, v in m.items()}
        flat["time/step"] = time.perf_counter() - t0
        log.scalars(step, flat)
        if config.train.log_records:
            log.records(records)
        accuracies = maybe_eval(step)
        if step % config.train.save_every == 0 or step == total_steps:
            metric = None if accuracies is None else float(np.mean(list(accuracies.values())))
            checkpointer.save(_snapshot(cohort, stream, step, history, nonfinite, metric))
        bar.set_postfix({f"{n}": f"r={m['reward']:.2f}" for n, m in metrics.items()})
        bar.update(1)
    bar.close()
    checkpointer.wait()
    checkpointer.close()
    log.close()
    summary = {"agents": history.summary(), "steps": total_steps, "nonfinite_updates": nonfinite,
               "best_checkpoint_step": _best_step(workdir)}
    if main:
        write_json(workdir / "summary.json", summary)
    for name, s in summary["agents"].items():
        _print(f"{name}: eval accuracy {s['initial_accuracy']} -> {s['final_accuracy']} "
                   f"(best {s['best_accuracy']} at step {s['best_step']})")
    return summary


def _check_nonfinite(counts: dict[str, int], limit: int, step: int) -> None:
    for name, n in counts.items():
        if n:
            logging.warning("agent %s: %d non-finite updates skipped so far (step %d)", name, n, step)
        if n > limit:
            raise FloatingPointError(
                f"agent {name}: {n} non-finite losses/gradients (more than train.max_nonfinite_updates={limit}); "
                "the last good checkpoint is kept in the workdir. Fix: lower the learning rate or use float32 "
                "compute, then resume")


def _snapshot(cohort: Cohort, stream: PromptStream, step: int, history: EvalHistory, nonfinite: dict,
              metric: float | None) -> Snapshot:
    state = {a.name: {"params": a.params, "opt_state": a.opt_state} for a in cohort.agents}
    return Snapshot(step=step, state=state, data_state=stream.get_state(),
                    rng={a.name: a.key for a in cohort.agents},
                    metadata={"eval_history": {n: {str(s): v for s, v in h.items()}
                                               for n, h in history.by_agent.items()},
                              "nonfinite": nonfinite},
                    metric=metric)


def _restore(checkpointer: Checkpointer, cohort: Cohort, stream: PromptStream, step: int):
    target = {a.name: {"params": a.params, "opt_state": a.opt_state} for a in cohort.agents}
    snap = checkpointer.restore(step, state_target=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target))
    for agent in cohort.agents:
        agent.params = snap.state[agent.name]["params"]
        agent.opt_state = snap.state[agent.name]["opt_state"]
        agent.key = snap.rng[agent.name]
    stream.set_state(snap.data_state)
    history = EvalHistory({n: {int(s): v for s, v in h.items()}
                           for n, h in snap.metadata.get("eval_history", {}).items()})
    return snap.step, history, dict(snap.metadata.get("nonfinite", {}))


def _best_step(workdir: str) -> int | None:
    with Checkpointer(workdir) as c:
        return c.best_step()


def _write_config(config: ml_collections.ConfigDict, workdir: epath.Path) -> None:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))


def _print(line: str) -> None:
    if multihost.is_main():
        tqdm.write(line)
