"""Paper-scale configs carry the reference launchers' settings (spec §2.1); their local variants stay small."""

from config_files import load_config
from corl_jax.config import validate
from corl_jax.data import load_problems


def test_ttrl_batch_is_the_reference_launchers():
    c = load_config("ttrl", "")
    validate(c)
    # 8 processes x per-device batch 3 x 64 accumulation steps = 1536 completions = 192 prompts x G=8
    assert (c.rollout.prompts_per_step, c.rollout.num_generations) == (192, 8)
    assert c.rollout.prompts_per_step * c.rollout.num_generations // c.grpo.micro_batch_size == 64
    for variant in ("tiny", "demo"):
        assert load_config("ttrl", variant).rollout.prompts_per_step <= 8


def test_ring3_evaluates_on_math500_and_its_variants_on_their_own_worlds():
    c = load_config("ring3", "")
    assert c.data.eval_path == "math500" and c.data.holdout_size == 150
    assert len(load_problems(c.data.eval_path)) == 500
    for variant in ("tiny", "demo"):
        assert load_config("ring3", variant).data.eval_path.startswith("arithmetic:test")
