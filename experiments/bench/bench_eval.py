"""MATH-500 generation at the reference's eval settings: `corl_jax.eval`'s sampling path vs transformers `generate`.

Random bf16 weights at a real model shape (experiments/bench/shapes.py; no download) with a byte-level tokenizer, so the
prompts are the MATH-500 problems in the reference's chat prompt, one token per byte. Settings as the reference's
final suite: T=0.6, top-p 0.95, up to 3072 new tokens with prompt + completion <= 4096 (vLLM max_model_len); random
weights never stop early, so every completion runs to its budget. Prompts are sorted by length and cut into batches
the same way for both sides (the budget of a batch is min(3072, 4096 - its longest prompt)).

Ours runs every problem (compile time reported apart); the transformers peer runs the first `--hf-problems` of the
same length-sorted order (a full MATH-500 pass at its speed would not fit one device command), and ours is also timed
on exactly that subset, so the ratio compares the same prompts and tokens.

  python experiments/bench/bench_eval.py --out experiments/results/bench_eval.json      # H200: Qwen2.5-1.5B shape
  python experiments/bench/bench_eval.py --tiny --out /tmp/bench_eval_tiny.json          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_sampling import device_name, versions
from shapes import SHAPES


def build_checkpoint(directory: Path, shape: str) -> Path:
    """A random checkpoint of `shape` with the real vocabulary size and a byte-level ChatML tokenizer."""
    from flax import nnx

    from corl_jax.demo.tokenizers import build_tokenizer
    from corl_jax.models import Decoder, ModelConfig, Policy, save_pretrained

    family, fields = SHAPES[shape]
    tokenizer = build_tokenizer(directory, "char", style="chatml")
    hf = dict(fields, model_type=family, rms_norm_eps=1e-6, rope_theta=1e6, eos_token_id=tokenizer.eos_token_id,
              bos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    hf.setdefault("max_position_embeddings", 4096)
    config = ModelConfig.from_hf_dict(hf)
    save_pretrained(Policy(config=config, model=Decoder(config, rngs=nnx.Rngs(0)), tokenizer=tokenizer), directory)
    return directory


def batches(lengths: list[int], size: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + size] for i in range(0, len(order), size)]


def run_ours(model, token_lists, settings, key):
    from corl_jax import eval as ev

    start = time.perf_counter()
    _, _, generated = ev.generate(model, token_lists, samples=1, max_new_tokens=settings.max_new_tokens,
                                  params=ev.sampling_params(settings), key=key, max_model_len=settings.max_model_len,
                                  batch_prompts=settings.batch_prompts)
    return time.perf_counter() - start, generated


def run_hf(directory, token_lists, settings, pad_id, eos_id, device):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").to(device).eval()
    generated, seconds = 0, 0.0
    for chunk in batches([len(t) for t in token_lists], settings.batch_prompts):
        rows = [token_lists[i] for i in chunk]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        budget = min(settings.max_new_tokens, settings.max_model_len - width)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=budget, do_sample=True,
                                 temperature=settings.temperature, top_p=settings.top_p, top_k=0,
                                 eos_token_id=eos_id, pad_token_id=pad_id)
        sync()
        seconds += time.perf_counter() - start
        new = out[:, width:]
        generated += int(((new != pad_id) | (new == eos_id)).sum())
    return seconds, generated


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--problems", type=int, default=500)
    p.add_argument("--hf-problems", type=int, default=64)
    p.add_argument("--batch-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=3072)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, 6 problems, 24 new tokens")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.problems, args.hf_problems, args.batch_prompts = "tiny", 6, 3, 3
        args.max_new_tokens, args.max_model_len = 24, 4096

    import jax

    from corl_jax import benchmarks as bm
    from corl_jax import eval as ev

    settings = ev.default_sampling()
    settings.update(max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len,
                    batch_prompts=args.batch_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_checkpoint(Path(tmp), args.shape)
        model = ev.load_model(args.shape, str(directory), dtype="bfloat16")
        items = bm.load_items("math500", "math500")[:args.problems]
        texts = ev.prompt_texts(model, items, chat=True)
        tokenizer = model.policy.tokenizer
        token_lists = tokenizer(texts, add_special_tokens=False)["input_ids"]
        subset = [token_lists[i] for chunk in batches([len(t) for t in token_lists], args.batch_prompts)
                  for i in chunk][:args.hf_problems]
        key = jax.random.key(0)
        log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
        log(f"ours: {len(token_lists)} problems, first pass (compiles)")
        full_s, full_tokens = run_ours(model, token_lists, settings, key)  # includes the compiles
        compile_s = sum(model.sampler.compile_seconds.values())
        log(f"ours: first pass {full_s:.1f} s, {full_tokens} tokens; warm pass")
        again_s, again_tokens = run_ours(model, token_lists, settings, key)  # warm: every program compiled
        sub_s, sub_tokens = run_ours(model, subset, settings, key)
        log(f"ours: warm pass {again_s:.1f} s; subset {sub_s:.1f} s, {sub_tokens} tokens; transformers on the subset")
        device = "cuda" if jax.default_backend() == "gpu" else "cpu"
        hf_s, hf_tokens = run_hf(directory, subset, settings, tokenizer.pad_token_id, tokenizer.eos_token_id, device)
    figures = {
        "problems": len(items), "prompt_tokens_min_max": [min(map(len, token_lists)), max(map(len, token_lists))],
        "ours_full_wall_s_with_compile": round(full_s, 2), "ours_compile_s": round(compile_s, 2),
        "ours_compiled_programs": len(model.sampler.programs),
        "ours_full_wall_s": round(again_s, 2), "ours_full_tokens": again_tokens,
        "ours_full_tokens_per_s": round(again_tokens / again_s, 1),
        "subset_problems": len(subset), "ours_subset_s": round(sub_s, 2), "ours_subset_tokens": sub_tokens,
        "ours_subset_tokens_per_s": round(sub_tokens / sub_s, 1),
        "hf_subset_s": round(hf_s, 2), "hf_subset_tokens": hf_tokens,
        "hf_subset_tokens_per_s": round(hf_tokens / hf_s, 1),
        "speedup_same_subset": round((sub_tokens / sub_s) / (hf_tokens / hf_s), 2),
    }
    result = {"command": " ".join([sys.executable, *sys.argv]), "device": device_name(), "versions": versions(),
              "shape": args.shape, "settings": settings.to_dict(), "figures": figures}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
