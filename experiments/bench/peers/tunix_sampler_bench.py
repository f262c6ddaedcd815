"""Peer: google-tunix's `tunix.generate.sampler.Sampler` at the shapes and settings of ../bench_sampling.py.

tunix's own Qwen2 / Llama3 / Qwen3 models (tunix.models.*.model) at the shapes of ../shapes.py, random weights from
their nnx initialisers cast to bf16 (no checkpoint: nothing can be downloaded), P prompts x G samples (each prompt
repeated G times: tunix has no num_samples, so every row is prefilled on its own), prompt length Tp, T new tokens
at forced length (the stop id is one past the vocabulary, so it can never be drawn), temperature 1.0 with
top_p=1.0 (tunix's full-vocabulary `jax.random.categorical` path). One warm-up (compiling) call, then the best of
`--repeats` timed calls; tokens/s = P*G*T / seconds and the HBM roofline fraction of bench_sampling.roofline().

The Sampler takes strings, through a tokenizer: a stub here "encodes" a string of space-separated token ids, so the
prompts are exact token ids (no bos added, pad id 0, which the prompts, drawn from [100, 1000), never contain).

Usage (GPU, from experiments/, with the tunix wheel on PYTHONPATH and the repo root for corl_jax):
  python peers/tunix_sampler_bench.py --out results/bench_sampling_tunix.json
  python peers/tunix_sampler_bench.py --models tiny --prompts 2 --samples 2 --prompt-len 16 --new-tokens 8  # CPU
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/bench/: shapes, bench_sampling

from shapes import SHAPES  # noqa: E402

# ------------------------------------------------------------------------------------------ import

def _install_tunix_package():
    """Put a bare `tunix` package into sys.modules before tunix is imported, standing in for tunix/__init__.py,
    which imports every trainer and RL learner (optax, orbax, grain, qwix, metrax, ...). The submodules used here
    (tunix.generate.sampler, tunix.models.*) load from the real package folder, unchanged."""
    spec = importlib.util.find_spec("tunix")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tunix is not importable: put the google-tunix wheel's folder on PYTHONPATH")
    package = types.ModuleType("tunix")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__version__ = importlib.metadata.version("google-tunix")
    sys.modules.setdefault("tunix", package)


# ------------------------------------------------------------------------------------------ models

class IdTokenizer:
    """The Sampler's tokenizer interface over strings of space-separated token ids."""

    def __init__(self, eos_id, pad_id=0):
        self._eos, self._pad = eos_id, pad_id

    def encode(self, text, **kw):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw):
        return ""  # the benchmark reads the token ids

    def bos_id(self):
        return None  # no bos prepended

    def eos_id(self):
        return self._eos

    def pad_id(self):
        return self._pad


def build_model(name, seed=0):
    """tunix model at the shapes of `name`, bf16 params (and bf16 compute where the model has a dtype setting)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    family, hf = SHAPES[name]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    common = dict(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
                  hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=head_dim,
                  num_kv_heads=hf["num_key_value_heads"])
    tied = hf.get("tie_word_embeddings", False)
    if family == "qwen2":
        from tunix.models.qwen2 import model as lib
        config = lib.ModelConfig(**common, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=tied,
                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        cls = lib.Qwen2
    elif family == "qwen3":
        from tunix.models.qwen3 import model as lib
        config = lib.ModelConfig(**common, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=tied,
                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        cls = lib.Qwen3
    elif family == "llama":
        from tunix.models.llama3 import model as lib
        # no dtype settings: its layers compute in the params' dtype
        config = lib.ModelConfig(**common, rope_theta=500_000, norm_eps=1e-5, weight_tying=tied)
        cls = lib.Llama3
    else:
        raise ValueError(f"no tunix model for family {family!r}")
    # tunix's initialisers (unit-normal embeddings, zero MLP kernels) give peaked logits (the Qwen2 model draws
    # nearly one token per prompt); speed does not depend on it: the full-vocabulary draw costs the same
    model = cls(config, rngs=nnx.Rngs(seed))
    # bf16 weights everywhere, as a bf16 checkpoint would load (the llama model is built in float32)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))})
    return model, config, n_params, dtypes


# ------------------------------------------------------------------------------------------ measurement

class CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (jax.monitoring duration events)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        import jax

        self.seconds = dict.fromkeys(self.EVENTS, 0.0)
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kw):
        if event in self.seconds:
            self.seconds[event] += duration

    def total(self):
        return sum(self.seconds.values())


def measure(args, name, clock):
    import jax
    import numpy as np
    from tunix.generate.sampler import CacheConfig, Sampler

    from bench_sampling import throughput

    model, config, n_params, dtypes = build_model(name)
    vocab = config.vocab_size
    eos = vocab  # one past the vocabulary: can never be drawn, so every row runs to max_generation_steps
    ids = np.asarray(jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_len), 100, min(1000, vocab)),
                     np.int32)
    rows_ids = np.repeat(ids, args.samples, axis=0)  # prompt i at rows i*G .. i*G+G-1, like num_samples=G
    prompts = [" ".join(map(str, r)) for r in rows_ids]
    batch = len(prompts)
    rows = []
    for new_tokens in args.new_tokens:
        cache = CacheConfig(cache_size=args.prompt_len + new_tokens, num_layers=config.num_layers,
                            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
        sampler = Sampler(model, IdTokenizer(eos_id=eos), cache)
        run = lambda seed: sampler(prompts, max_generation_steps=new_tokens,  # noqa: E731
                                   max_prompt_length=args.prompt_len, echo=False, eos_tokens=[eos],
                                   temperature=1.0, top_p=1.0, top_k=None, seed=seed)
        compile_before = clock.total()
        start = time.perf_counter()
        out = run(0)  # compiles prefill and decode
        first = time.perf_counter() - start
        compile_s = clock.total() - compile_before
        times = []
        for rep in range(args.repeats):
            start = time.perf_counter()
            out = run(rep + 1)
            times.append(time.perf_counter() - start)
        lengths = [len(t) for t in out.tokens]
        generated = np.stack(out.tokens)
        assert min(lengths) == max(lengths) == new_tokens, f"output lengths {min(lengths)}..{max(lengths)}"
        assert generated.min() >= 0 and generated.max() < vocab
        # the token buffer starts as pad ids (0): a row not really sampled would stay 0
        pad_fraction = float((generated == 0).mean())
        assert pad_fraction < 0.01, f"{pad_fraction:.3f} of the generated tokens are the pad id"
        stats = jax.devices()[0].memory_stats() or {}
        row = dict(impl="tunix.Sampler", model=name, batch=batch, prompt=args.prompt_len, new=new_tokens,
                   params=n_params, param_dtypes=dtypes, cache_dtype=np.dtype(sampler.dtype).name,
                   repeat_compile_s=round(clock.total() - compile_before - compile_s, 2),
                   compile_s=round(compile_s, 1), first_call_s=round(first, 2),
                   first_call_minus_compile_s=round(first - compile_s, 3),
                   **throughput(times, batch, args.prompt_len, new_tokens, n_params, config),
                   output_lengths=[min(lengths), max(lengths)], distinct_tokens=int(np.unique(generated).size),
                   peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2))
        print(row, flush=True)
        rows.append(row)
        del sampler, out
    del model
    return rows


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    from bench_sampling import add_shape_arguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, [512])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=0,
                   help="skip a model when the seconds spent plus those of the slowest model so far would pass "
                        "this (0: no limit)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


TUNIX_PACKAGES = ("jax", "jaxlib", "flax", "google-tunix")


def main():
    args = parse_args()
    started = time.perf_counter()
    _install_tunix_package()
    import jax

    from bench_sampling import device_name, versions

    clock = CompileClock()
    ours_file = Path(__file__).resolve().parents[2] / "results" / "bench_sampling.json"
    ours = json.loads(ours_file.read_text())["corl_jax"] if ours_file.exists() else []
    rows, ratios, skipped = [], [], []

    def report():
        ratios.clear()
        for row in rows:
            # corl_jax's row at the same model and length: the last one (the variant chosen for the rest)
            match = [r for r in ours if "error" not in row and "error" not in r
                     and r["model"] == row["model"] and r["new"] == row["new"]]
            if match:
                ratios.append(dict(model=row["model"], new=row["new"], corl_jax_variant=match[-1]["variant"],
                                   corl_jax_tokens_per_s=match[-1]["tokens_per_s"],
                                   tunix_tokens_per_s=row["tokens_per_s"],
                                   corl_jax_over_tunix=round(match[-1]["tokens_per_s"] / row["tokens_per_s"], 2)))
        result = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), device=device_name(),
                      backend=jax.default_backend(), versions=versions(TUNIX_PACKAGES),
                      settings=dict(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                                    repeats=args.repeats, temperature=1.0, top_p=1.0, top_k=None,
                                    stop_ids="one past the vocabulary (forced length)",
                                    prefill="every row (prompts repeated G times)",
                                    attention="tunix's XLA einsum attention over the whole cache "
                                              "(use_flash_attention=False: its flash path is TPU splash only)"),
                      tunix_sampler=rows, skipped_models=skipped, corl_jax_over_tunix=ratios)
        if args.out:  # rewritten after every model, so a cut-off run keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"backend {jax.default_backend()}, versions {versions(TUNIX_PACKAGES)}", flush=True)
    longest = 0.0  # seconds of the slowest model so far: the guess for the next one
    for name in args.models:
        elapsed = time.perf_counter() - started
        if args.budget_s and elapsed + longest > args.budget_s:
            print(f"skipped {name}: {elapsed:.0f} s spent + {longest:.0f} s expected > --budget-s", flush=True)
            skipped.append(name)
            continue
        try:
            rows.extend(measure(args, name, clock))
        except Exception as e:
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            rows.append(dict(impl="tunix.Sampler", model=name, error=f"{type(e).__name__}: {str(e)[:500]}"))
        longest = max(longest, time.perf_counter() - started - elapsed)
        report()
    report()
    print(f"{'impl':14s} {'model':14s} {'new':>5s} {'tok/s':>8s} {'ms/step':>8s} {'roof%':>6s} {'compile':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:14s} {r['model']:14s} ERROR {r['error'][:80]}")
            continue
        print(f"{r['impl']:14s} {r['model']:14s} {r['new']:5d} {r['tokens_per_s']:8d} {r['ms_per_step']:8.2f} "
              f"{100 * r['frac_of_roofline']:6.1f} {r['compile_s']:8.1f}")
    for r in ratios:
        print(f"corl_jax / tunix: {r}")


if __name__ == "__main__":
    main()
