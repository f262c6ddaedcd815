"""The lm-evaluation-harness backend `corl_jax` against lm-eval's own `hf` model on the same checkpoint, through
`lm_eval.simple_evaluate` on offline tasks that read a local JSONL file: loglikelihood (multiple choice),
loglikelihood_rolling and generate_until."""

from __future__ import annotations

import json

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")  # the `eval` extra (also in `test`)

from hf_tiny import make_tiny_hf_checkpoint  # noqa: E402

PASSAGE = "A passage longer than one 48-token window, so that the rolling log-likelihood spans several of them."
ROWS = [{"question": "What is 2 + 3?", "choices": ["5", "6", " seven"], "label": 0, "answer": "5", "passage": PASSAGE},
        {"question": "Name a color.", "choices": ["red", "dog", "run"], "label": 0, "answer": "red", "passage": "Hi."},
        {"question": "Count: 1 2 3", "choices": [" 4", " 9", " x"], "label": 0, "answer": "4", "passage": PASSAGE * 2}]

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: {target}
"""
EXTRA = {
    "local_mc": ("multiple_choice", "label", 'doc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n'),
    "local_gen": ("generate_until", "answer", "generation_kwargs:\n  until: [\"\\n\\n\", \"Q:\"]\n"
                  "  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"),
    "local_rolling": ("loglikelihood_rolling", "passage", "metric_list:\n  - metric: word_perplexity\n"),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    data = root / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    tasks = root / "tasks"
    tasks.mkdir()
    for name, (output_type, target, extra) in EXTRA.items():
        (tasks / f"{name}.yaml").write_text(TASK.format(name=name, data=data, output_type=output_type,
                                                        target=target) + extra)
    return make_tiny_hf_checkpoint(root / "ckpt", "llama", max_position_embeddings=48), tasks


def responses(model, model_args, tasks):
    from lm_eval.tasks import TaskManager

    import corl_jax.lm_eval_model  # noqa: F401  (registers the model type)

    result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(EXTRA),
                                     task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
    return {task: [s["resps"] for s in result["samples"][task]] for task in EXTRA}


def test_corl_jax_backend_matches_lm_evals_hf_model(setup, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    directory, tasks = setup
    ours = responses("corl_jax", f"path={directory},dtype=float32,batch_size=2,max_length=48", tasks)
    theirs = responses("hf", f"pretrained={directory},dtype=float32,device=cpu,max_length=48", tasks)
    for task in ("local_mc", "local_rolling"):
        a, b = (np.array([[r[0][0] if task == "local_mc" else r[0] for r in doc] for doc in x], dtype=float)
                for x in (ours[task], theirs[task]))
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
    greedy = [[[r[0][1] for r in doc] for doc in x["local_mc"]] for x in (ours, theirs)]
    assert greedy[0] == greedy[1]
    assert ours["local_gen"] == theirs["local_gen"] and any(r[0][0] for r in ours["local_gen"])


def test_model_args_name_the_fix():
    import corl_jax.lm_eval_model as backend

    with pytest.raises(ValueError, match="either path=HF_DIR or workdir=DIR,agent=NAME"):
        backend.CorlJaxLM()
    with pytest.raises(ValueError, match="needs agent=NAME"):
        backend.CorlJaxLM(workdir="/nonexistent")
