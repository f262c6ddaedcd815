"""Host-side helper from problem texts to completion texts (tokenize -> `Sampler` -> detokenize)."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from corl_jax.sampling.controls import SamplingParams
from corl_jax.sampling.engine import Completions, Sampler
from corl_jax.tokenization import decode_completions, encode_prompts


def generate_texts(sampler: Sampler, tokenizer, problems: Sequence[str], *, num_samples: int, max_new_tokens: int,
                   params: SamplingParams, key: jax.Array, chat_template: str | None = None,
                   ) -> tuple[list[list[str]], Completions]:
    """Samples `num_samples` completions per problem, each prompt built as the reference builds it
    (one user turn through the chat template). Returns (texts[p][g], the token-level `Completions`);
    texts are decoded with special tokens skipped, as the reference does."""
    ids, mask = encode_prompts(tokenizer, problems, bucket=sampler.buckets.prompt, chat_template=chat_template)
    completions = sampler.generate(ids, mask, num_samples=num_samples, max_new_tokens=max_new_tokens, params=params,
                                   key=key)
    texts = decode_completions(tokenizer, np.asarray(completions.tokens), np.asarray(completions.mask))
    return [texts[p * num_samples:(p + 1) * num_samples] for p in range(len(problems))], completions
