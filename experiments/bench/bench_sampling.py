"""Sampler throughput on one GPU against the HBM roofline and the transformers `generate` peer.

Random bf16 weights at the shapes of Qwen2.5-1.5B, Llama-3.2-1B and Qwen3-0.6B (configs built
directly: no download); P prompts x G samples, prompt length Tp, forced length (no stop ids).

Roofline (as ../shared/bench/hf_generate_bench.py): one decode step must read every weight once
plus the KV cache of every row; with the average context Tp + T/2,
  step_bytes = 2 * n_params + B * (Tp + T/2) * kv_bytes_per_token,   roofline tok/s = B / (step_bytes / 4.3e12).

Usage (GPU; each part prints a table and writes one JSON):
  python experiments/bench/bench_sampling.py --out experiments/results/bench_sampling.json
  python experiments/bench/bench_sampling.py --models qwen2.5-1.5b --new-tokens 512 --variants pallas,xla-seg128 \
      --hf-peer none --profile-steps 24 --dump-dir /tmp/profile
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from corl_jax.sampling import engine
from shapes import SHAPES

HBM_BYTES_PER_S = 4.3e12
_GRAPHS = {"xla_gpu_enable_command_buffer": engine.GPU_COMPILER_OPTIONS["xla_gpu_enable_command_buffer"]}
# Sampler variants: name -> (decode attention, attention segment width in steps for "xla" (0: the whole cache),
# XLA options, decode_attention kernel settings for "pallas" (None: its defaults)).
VARIANTS = {
    "pallas": ("pallas", 0, {}, None),  # {}: XLA's own defaults, not the Sampler's GPU defaults
    "pallas+graphs": ("pallas", 0, _GRAPHS, None),
    "pallas+graphs:b32s128": ("pallas", 0, _GRAPHS, dict(block_k=32, split=128)),
    "pallas+graphs:b128s512": ("pallas", 0, _GRAPHS, dict(block_k=128, split=512)),
    # cuBLAS for every matmul (XLA otherwise emits Triton split-K GEMMs for the small q/k/v and o projections)
    "pallas+graphs+cublas": ("pallas", 0, engine.GPU_COMPILER_OPTIONS, None),  # the Sampler's default on GPUs
    "pallas+graphs+cublas:w8": ("pallas", 0, engine.GPU_COMPILER_OPTIONS, dict(num_warps=8)),
    "pallas+graphs+cublas:st3": ("pallas", 0, engine.GPU_COMPILER_OPTIONS, dict(num_stages=3)),
    "pallas+graphs+cublas:b128s512": ("pallas", 0, engine.GPU_COMPILER_OPTIONS, dict(block_k=128, split=512)),
    "pallas+graphs+cublas:s128": ("pallas", 0, engine.GPU_COMPILER_OPTIONS, dict(split=128)),
    "pallas+graphs+cublaslt": ("pallas", 0, {**engine.GPU_COMPILER_OPTIONS, "xla_gpu_enable_cublaslt": True}, None),
    "pallas+graphs+cudnn-gemm": ("pallas", 0, {**engine.GPU_COMPILER_OPTIONS, "xla_gpu_cudnn_gemm_fusion_level": 3},
                                 None),
    "xla-seg128": ("xla", 128, {}, None),
    "xla-seg128+graphs": ("xla", 128, _GRAPHS, None),
    "xla-full+graphs": ("xla", 0, _GRAPHS, None),
}


def roofline(n_params, config, batch, prompt_len, new_tokens):
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2  # bf16 K and V
    step_bytes = 2 * n_params + batch * (prompt_len + new_tokens / 2) * kv_per_token
    return batch / (step_bytes / HBM_BYTES_PER_S)


def throughput(times, batch, prompt_len, new_tokens, n_params, config) -> dict:
    """Row fields of the fastest of `times` (seconds per generation of `new_tokens` tokens for `batch` rows):
    seconds, tokens/s, ms per decode step and the fraction of the HBM roofline."""
    seconds = min(times)
    tps = batch * new_tokens / seconds
    roof = roofline(n_params, config, batch, prompt_len, new_tokens)
    return dict(seconds=round(seconds, 3), all_seconds=[round(t, 3) for t in times], tokens_per_s=round(tps),
                ms_per_step=round(1e3 * seconds / new_tokens, 3), roofline_tokens_per_s=round(roof),
                frac_of_roofline=round(tps / roof, 4))


# ------------------------------------------------------------------------------------------ ours

def bench_ours(args, on_row=lambda rows: None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from corl_jax.models import Decoder, ModelConfig
    from corl_jax.sampling import SamplingParams

    rows = []
    candidates = list(args.variants)
    extra = list(args.extra_variants)
    for name in args.models:
        family, hf = SHAPES[name]
        config = ModelConfig.from_hf_dict({"model_type": family, **hf}, param_dtype=jnp.bfloat16)
        model = Decoder(config, rngs=nnx.Rngs(0))
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        ids = np.asarray(jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_len), 100,
                                                    min(1000, config.vocab_size)), np.int32)
        mask = np.ones_like(ids, bool)
        params = SamplingParams(temperature=1.0)
        for new_tokens in args.new_tokens:
            measured = []
            for variant in candidates:
                profile = new_tokens == args.new_tokens[0] and variant == candidates[0]
                row = measure(args, name, model, config, n_params, ids, mask, params, new_tokens, variant, profile)
                rows.append(row)
                measured.append(row)
                on_row(rows)
            if len(candidates) > 1:  # explored on the first (model, length): keep the fastest
                candidates = [max((r for r in measured if "error" not in r), key=lambda r: r["tokens_per_s"])["variant"]]
                print(f"chosen variant: {candidates[0]}", flush=True)
        extra_shape = (args.models[0], args.new_tokens[0])
        if name == extra_shape[0]:
            extra_model = (model, config, n_params, ids, mask, params)
        else:
            del model
    for variant in extra:  # last, on the first shape only: slow-compiling candidates
        rows.append(measure(args, extra_shape[0], *extra_model[:5], extra_model[5], extra_shape[1], variant, False))
        on_row(rows)
    return rows


def measure(args, name, model, config, n_params, ids, mask, params, new_tokens, variant, profile):
    """One sampler variant at one length: compile, then time `args.repeats` full generations."""
    import jax

    from corl_jax.models import decode_attention
    from corl_jax.sampling import Buckets, Sampler

    attention, kv_block, options, kernel = VARIANTS[variant]
    # kernel block sizes are not a Sampler setting: this script swaps the engine's kernel for a tuned partial
    engine.decode_attention = functools.partial(decode_attention.decode_attention, **(kernel or {}))
    jax.clear_caches()  # or jit would reuse the trace made with the previous kernel settings
    sampler = Sampler(model, stop_ids=(), buckets=Buckets(prompt=64, new_tokens=256, kv_block=kv_block),
                      compiler_options=options, attention=attention)
    run = lambda n, seed: jax.block_until_ready(sampler.generate(  # noqa: E731
        ids, mask, num_samples=args.samples, max_new_tokens=n, params=params, key=jax.random.key(seed)))
    try:
        start = time.perf_counter()
        run(new_tokens, 0)  # compiles
        first = time.perf_counter() - start
    except Exception as e:  # keep measuring the other variants
        print(f"FAILED {name} {new_tokens} {variant}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
        return dict(impl="corl_jax", model=name, new=new_tokens, variant=variant,
                    error=f"{type(e).__name__}: {str(e)[:500]}")
    compile_s = sum(sampler.compile_seconds.values())
    times = []
    for rep in range(args.repeats):
        start = time.perf_counter()
        out = run(new_tokens, rep + 1)
        times.append(time.perf_counter() - start)
    assert out.tokens.shape == (args.prompts * args.samples, new_tokens) and bool(out.mask.all())
    batch = args.prompts * args.samples
    stats = jax.devices()[0].memory_stats() or {}
    memory = next(iter(sampler.programs.values())).memory_analysis()
    row = dict(impl="corl_jax", model=name, batch=batch, prompt=args.prompt_len, new=new_tokens,
               variant=variant, params=n_params, compile_s=round(compile_s, 1),
               first_call_minus_compile_s=round(first - compile_s, 3),
               **throughput(times, batch, args.prompt_len, new_tokens, n_params, config),
               peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
               program_gib=round((memory.argument_size_in_bytes + memory.output_size_in_bytes
                                  + memory.temp_size_in_bytes) / 2**30, 2))
    print(row, flush=True)
    if args.dump_dir and profile:
        dump_program_and_profile(args, sampler, run, name, new_tokens, hlo=name == args.models[0])
    return row


def dump_program_and_profile(args, sampler, run, name, new_tokens, hlo=True):
    """Optimised HLO of the program, and a kernel-time profile of a short generation (op by op)."""
    import jax

    out = Path(args.dump_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hlo:
        with gzip.open(out / f"{name}_hlo.txt.gz", "wt") as f:
            f.write(next(iter(sampler.programs.values())).as_text())
    if not args.profile_steps:
        return
    trace_dir = out / "trace_tmp"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        run(args.profile_steps, 99)
    trace = next(trace_dir.rglob("perfetto_trace.json.gz"))
    summary = kernel_summary(json.load(gzip.open(trace)))
    shutil.rmtree(trace_dir)
    summary.update(model=name, steps=args.profile_steps)
    (out / f"{name}_kernels.json").write_text(json.dumps(summary, indent=1))
    print(f"profile of {args.profile_steps} steps, {name}: GPU busy {summary['gpu_busy_ms']:.1f} ms "
          f"over {summary['wall_ms']:.1f} ms")
    for k in summary["top"][:25]:
        print(f"  {k['ms']:9.2f} ms  x{k['count']:6d}  {k['name'][:110]}")


def kernel_summary(trace):
    events = trace["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    by_name = defaultdict(lambda: [0.0, 0, None])
    for e in kernels:
        entry = by_name[e["name"]]
        entry[0] += e.get("dur", 0.0)
        entry[1] += 1
        entry[2] = entry[2] or e.get("args")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    start = min((e["ts"] for e in kernels), default=0.0)
    end = max((e["ts"] + e.get("dur", 0.0) for e in kernels), default=0.0)
    return dict(gpu_busy_ms=sum(v[0] for v in by_name.values()) / 1e3, wall_ms=(end - start) / 1e3,
                top=[dict(name=k, ms=v[0] / 1e3, count=v[1], args=v[2]) for k, v in top[:80]])


def bench_sampling_step(args):
    """Time of `sample_tokens` alone on float32 logits [B, V] for several settings (median of 20 calls)."""
    import jax
    import jax.numpy as jnp

    from corl_jax.sampling import SamplingParams, sample_tokens

    batch, vocab = args.prompts * args.samples, 151936
    logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.float32) * 3
    # "flat" logits overflow the top_p candidates (exact sort fallback); "peaked" ones (scale 12) do not
    cases = [("flat", logits, p) for p in (SamplingParams(), SamplingParams(temperature=0.6, min_p=0.05),
                                           SamplingParams(top_k=50), SamplingParams(top_p=0.95))]
    cases.append(("peaked", logits * 4, SamplingParams(top_p=0.95)))
    def gumbel_max(logits, key, params):  # the previous default draw (one Gumbel number per vocabulary entry)
        z = logits / params.temperature
        return jnp.argmax(z + jax.random.gumbel(key, z.shape), axis=-1), jax.nn.logsumexp(z, axis=-1)

    cases.append(("flat", logits, SamplingParams(), gumbel_max))
    rows = []
    for kind, logits, params, *draw in cases:
        fn = jax.jit(draw[0] if draw else sample_tokens, static_argnums=2)
        jax.block_until_ready(fn(logits, jax.random.key(1), params))
        times = []
        for i in range(20):
            start = time.perf_counter()
            jax.block_until_ready(fn(logits, jax.random.key(i), params))
            times.append(time.perf_counter() - start)
        row = dict(logits=kind, params=str(params), draw="gumbel-max" if draw else "sample_tokens", batch=batch,
                   vocab=vocab, ms=round(1e3 * sorted(times)[10], 3))
        print(row, flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ peer

def bench_hf(args):
    """transformers `generate` (sdpa, bf16, sampling at temperature 1, forced length) at the same shapes."""
    import torch
    import transformers

    rows = []
    for name in args.models:
        family, hf = SHAPES[name]
        config = transformers.AutoConfig.for_model(family, **hf)
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                  attn_implementation="sdpa")
        model.eval()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        n_params = sum(p.numel() for p in model.parameters())
        batch = args.prompts * args.samples
        ids = torch.randint(100, min(1000, config.vocab_size), (batch, args.prompt_len), device=device)
        mask = torch.ones_like(ids)
        for new_tokens in args.hf_new_tokens:
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                      top_p=1.0, top_k=0, pad_token_id=0)
            with torch.no_grad():
                model.generate(ids[:, :32], attention_mask=mask[:, :32], **{**kw, "max_new_tokens": 8,
                                                                             "min_new_tokens": 8})
                sync()
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, **kw)
                sync()
                seconds = time.perf_counter() - start
            assert out.shape[1] == args.prompt_len + new_tokens, "generate stopped before the forced length"
            row = dict(impl="transformers.generate", model=name, batch=batch, prompt=args.prompt_len, new=new_tokens,
                       params=n_params,
                       **throughput([seconds], batch, args.prompt_len, new_tokens, n_params, _our_config(name)))
            print(row, flush=True)
            rows.append(row)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _our_config(name):
    from corl_jax.models import ModelConfig

    family, hf = SHAPES[name]
    return ModelConfig.from_hf_dict({"model_type": family, **hf})


# ------------------------------------------------------------------------------------------ main

def versions(packages=("jax", "jaxlib", "flax", "torch", "transformers")):
    """Python's and the installed distributions' versions (None where one is missing)."""
    out = {"python": platform.python_version()}
    for dist in packages:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def device_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"


def _ints(text):
    return [int(x) for x in text.split(",")]


def add_shape_arguments(p, new_tokens):
    """The shape flags shared with the peers' scripts: models, prompts, samples per prompt, prompt and new tokens."""
    p.add_argument("--models", type=lambda s: s.split(","), default=[m for m in SHAPES if m != "tiny"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=_ints, default=new_tokens)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(p, [512, 1024])
    p.add_argument("--variants", type=lambda s: s.split(","), default=["pallas+graphs"],
                   help=f"sampler variants, from {list(VARIANTS)}; with several, all are measured on the first "
                        "model and length and the fastest is used for the rest")
    p.add_argument("--extra-variants", type=lambda s: s.split(",") if s else [], default=[],
                   help="variants measured last, on the first model and length only")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hf-peer", choices=["run", "none", "only"], default="run",
                   help="run the transformers peer in a subprocess first (none: skip; only: this process is it)")
    p.add_argument("--hf-new-tokens", type=_ints, default=[512])
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--dump-dir", default=None, help="write optimised HLO and a kernel profile here")
    p.add_argument("--sampling-step", action="store_true", help="also time sample_tokens alone")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main():
    args = parse_args()
    if args.hf_peer == "only":
        rows = bench_hf(args)
        print("HF_ROWS=" + json.dumps(rows))
        if args.out:
            report = dict(command=" ".join([Path(sys.executable).name, *sys.argv]), device=device_name(),
                          versions=versions(), transformers_generate=rows)
            Path(args.out).write_text(json.dumps(report, indent=1))
        return
    peer = []
    if args.hf_peer == "run":  # before JAX takes the GPU
        command = [sys.executable, __file__, *sys.argv[1:], "--hf-peer", "only", "--out", ""]
        result = subprocess.run(command, capture_output=True, text=True)
        sys.stderr.write(result.stderr[-3000:])
        print(result.stdout)
        lines = [line for line in result.stdout.splitlines() if line.startswith("HF_ROWS=")]
        peer = json.loads(lines[-1][len("HF_ROWS="):]) if lines else []
    command = " ".join([Path(sys.executable).name, *sys.argv])

    def report(ours, sampling_step=()):
        ratios = []
        for row in ours:
            match = [p for p in peer if "error" not in row and p["model"] == row["model"] and p["new"] == row["new"]]
            if match:
                ratios.append(dict(model=row["model"], new=row["new"], variant=row["variant"],
                                   speedup_vs_hf=round(row["tokens_per_s"] / match[0]["tokens_per_s"], 1)))
        result = dict(command=command, device=device_name(), versions=versions(),
                      xla_flags=os.environ.get("XLA_FLAGS", ""), hbm_bytes_per_s=HBM_BYTES_PER_S,
                      settings=dict(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                                    temperature=1.0, stop_ids="none (forced length)"),
                      corl_jax=ours, transformers_generate=peer, sampling_step=list(sampling_step), speedups=ratios)
        if args.out:  # rewritten after every measurement, so a cut-off run keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        return result

    ours = bench_ours(args, on_row=report)
    result = report(ours, bench_sampling_step(args) if args.sampling_step else [])
    print(f"{'impl':22s} {'model':14s} {'new':>5s} {'variant':>32s} {'tok/s':>8s} {'ms/step':>8s} {'roof%':>6s} "
          f"{'compile':>8s} {'progGiB':>8s}")
    for r in ours + peer:
        if "error" in r:
            continue
        print(f"{r['impl']:22s} {r['model']:14s} {r['new']:5d} {r.get('variant', ''):>32s} {r['tokens_per_s']:8d} "
              f"{r.get('ms_per_step', 0):8.2f} {100 * r['frac_of_roofline']:6.1f} {r.get('compile_s', 0):8.1f} "
              f"{r.get('program_gib', 0):8.2f}")
    for r in result["speedups"]:
        print(f"speedup vs transformers: {r}")

if __name__ == "__main__":
    main()
