"""The training loop: data, in-loop evaluation, checkpoints and metrics around `Cohort.step`."""

from __future__ import annotations

import signal
import threading
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from tqdm import tqdm

from corl_jax import multihost
from corl_jax import workdir as run_dir
from corl_jax.checkpointing import Checkpointer, Snapshot
from corl_jax.cohort import Cohort, check_prompt_lengths, load_agents
from corl_jax.data import PromptStream, load_train_and_eval
from corl_jax.metrics import RunLog, write_json
from corl_jax.runs import EvalHistory


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


class Interrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving the step it had finished."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; its checkpoint is saved. "
                         "Resume: run the same command again")
        self.signum, self.step = signum, step


class StopRequest:
    """While active, SIGINT/SIGTERM only set `signum` (`train` then finishes its step, saves and raises
    Interrupted). A second signal gets the previous handler: stop at once, the last checkpoint stands."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        tqdm.write(f"{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                   "(signal again to stop at once without saving)")

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def train(config: ml_collections.ConfigDict, workdir: str, stop: StopRequest | None = None) -> dict:
    """Train (or resume) the run of `config` in `workdir`; returns the summary written to summary.json.

    Its "faults" list names what went wrong and was recovered from (a damaged checkpoint set aside), over the
    whole run; `corl_jax.train` then exits non-zero. Once `stop` has caught a signal, the step in progress is
    finished and saved, then Interrupted is raised."""
    workdir = epath.Path(workdir)
    changes = _prepare_workdir(config, workdir)
    train_problems, eval_problems = load_train_and_eval(
        config.data, train_needs_answers=config.method == "gt_reward")
    total_steps = config.train.max_steps
    cohort = Cohort(config, load_agents(config, total_steps))
    lengths = dict(max_prompt_len=config.rollout.max_prompt_len, skip_bad_rows=config.data.skip_bad_rows)
    train_problems = check_prompt_lengths(cohort.agents, train_problems, **lengths)
    eval_problems = check_prompt_lengths(cohort.agents, eval_problems, **lengths)
    stream = PromptStream(train_problems, config.rollout.prompts_per_step, config.data_seed)
    # Synchronous saves: the next update donates the parameter buffers that a pending async save would still read.
    checkpointer = Checkpointer(workdir, keep_last=config.train.keep_last, async_save=False)
    history = EvalHistory({})
    nonfinite = {a.name: 0 for a in cohort.agents}
    faults: list[str] = []
    start = 0
    if checkpointer.agreed_latest_step() is not None:
        start, history, nonfinite, faults = _restore(checkpointer, cohort, stream, config.train.fallback_to_previous)
        logging.info("resumed from step %d of %s", start, workdir)
    main = multihost.is_main()  # one process writes the run's files and prints; all of them save checkpoints
    if main:
        run_dir.record_config(config, workdir, start, changes)
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
        flat.update(memory_metrics())
        log.scalars(step, flat)
        if config.train.log_records:
            log.records(records)
        # Every process stops after the same step (a signal may reach them in different steps).
        stopping = multihost.any_process(stop is not None and stop.signum is not None)
        accuracies = None if stopping else maybe_eval(step)
        # An agent's new best is saved even off the save_every schedule, so every best step has its weights.
        new_best = accuracies is not None and any(history.best_step(name) == step for name in accuracies)
        if step % config.train.save_every == 0 or step == total_steps or new_best or stopping:
            checkpointer.save(_snapshot(cohort, stream, step, history, nonfinite, faults, accuracies))
        bar.set_postfix({f"{n}": f"r={m['reward']:.2f}" for n, m in metrics.items()})
        bar.update(1)
        if stopping:
            checkpointer.close()
            log.close()
            raise Interrupted(stop.signum or signal.SIGTERM, step)  # None: another process was signalled
    bar.close()
    checkpointer.wait()
    checkpointer.close()
    log.close()
    summary = {"agents": history.summary(), "steps": total_steps, "nonfinite_updates": nonfinite, "faults": faults}
    if main:
        write_json(workdir / "summary.json", summary)
    for name, s in summary["agents"].items():
        best = "no step beat the base model (step 0)" if s["best_is_base"] else f"at step {s['best_step']}"
        _print(f"{name}: eval accuracy {s['initial_accuracy']} -> {s['final_accuracy']} "
               f"(best {s['best_accuracy']} {best})")
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
              faults: list[str], accuracies: dict[str, float] | None) -> Snapshot:
    state = {a.name: {"params": a.params, "opt_state": a.opt_state} for a in cohort.agents}
    return Snapshot(step=step, state=state, data_state=stream.get_state(),
                    rng={a.name: a.key for a in cohort.agents},
                    metadata={"eval_history": history.to_json(), "nonfinite": nonfinite, "faults": faults,
                              "tokens_seen": {a.name: a.tokens_seen for a in cohort.agents}},
                    metric=accuracies)  # per agent: the checkpointer keeps every agent's best step


def _restore(checkpointer: Checkpointer, cohort: Cohort, stream: PromptStream, fallback: bool):
    """Load the latest good checkpoint into the cohort and the stream; (step, history, nonfinite, faults).

    The cohort's freshly initialised parameters and optimiser state are freed first: the restore reads into new
    buffers, and a cohort at paper sizes does not fit its device twice (a failed restore ends the run anyway)."""
    initial = {a.name: {"params": a.params, "opt_state": a.opt_state} for a in cohort.agents}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), initial)
    for x in jax.tree.leaves(initial):
        if not x.is_deleted():
            x.delete()
    for agent in cohort.agents:
        agent.params = agent.opt_state = None
    snap = checkpointer.restore(state_target=target, fallback_to_previous=fallback)
    for agent in cohort.agents:
        agent.params = snap.state[agent.name]["params"]
        agent.opt_state = snap.state[agent.name]["opt_state"]
        agent.key = snap.rng[agent.name]
        agent.tokens_seen = snap.metadata.get("tokens_seen", {}).get(agent.name, 0)
    stream.set_state(snap.data_state)
    history = EvalHistory.from_json(snap.metadata.get("eval_history", {}))
    faults = [f"checkpoint step {bad} was damaged ({why}); moved to {checkpointer.rejected_directory}, resumed from "
              f"step {snap.step}" for bad, why in checkpointer.rejected.items()]
    return snap.step, history, dict(snap.metadata.get("nonfinite", {})), snap.metadata.get("faults", []) + faults


def _prepare_workdir(config: ml_collections.ConfigDict, workdir: epath.Path) -> dict:
    """`workdir.prepare` on process 0 (it may move an old run aside); the others go on (and look for checkpoints)
    once it is done, and raise its WorkdirError, with its message, too."""
    return multihost.first_error(lambda: run_dir.prepare(config, workdir), (run_dir.WorkdirError,)) or {}


def _print(line: str) -> None:
    if multihost.is_main():
        tqdm.write(line)


def memory_metrics() -> dict[str, int]:
    """`memory/{peak_bytes_in_use,bytes_in_use,bytes_limit}`: the largest over this process's devices of what their
    allocator reports (GPU/TPU); empty where devices report no memory stats (CPU)."""
    out: dict[str, int] = {}
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        for key in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit"):
            if key in stats:
                out[f"memory/{key}"] = max(out.get(f"memory/{key}", 0), int(stats[key]))
    return out
