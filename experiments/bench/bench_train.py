"""GRPO update throughput and MFU at the Qwen2.5-1.5B shape, beside the PyTorch (HF transformers) peer.

One optimiser step of `corl_jax.cohort.update` (the trainer's own jitted update: fp32 master weights, bf16 compute,
vocabulary-safe chunked log-probs, micro-batch gradient accumulation, global-norm clip + AdamW) on 128 sequences of
768 tokens (256 prompt + 512 completion), random weights. The peer, `experiments/bench/peers/hf_train_bench.py` (a copy of
shared/bench/hf_train_bench.py), runs in the same command on the same GPU.

    python experiments/bench/bench_train.py --out experiments/results/bench_train.json [--peer]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from corl_jax.cohort import UpdateSettings, update
from corl_jax.models import Decoder, ModelConfig
from shapes import SHAPES

PEAK_BF16 = 989e12  # H200 dense bf16 datasheet (the peer's MFU denominator)


def model_flops(c: ModelConfig, batch: int, seq: int, scored: int) -> float:
    """Training FLOPs (3x forward) of one step: matmuls of every layer on every token, causal attention,
    and the unembedding on the scored (completion) positions."""
    per_layer = 2 * c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, k, v
    per_layer += 2 * c.num_heads * c.head_dim * c.hidden_size  # o
    per_layer += 3 * 2 * c.hidden_size * c.intermediate_size  # gate, up, down
    forward = c.num_layers * per_layer * batch * seq
    forward += c.num_layers * 2 * batch * c.num_heads * c.head_dim * seq * seq  # QK^T and PV, causal half
    forward += 2 * c.hidden_size * c.vocab_size * batch * scored
    return 3.0 * forward


def bench(shape: str, micro_batch: int, remat: str, attention: str, batch: int, prompt: int, completion: int,
          steps: int) -> dict:
    family, hf = SHAPES[shape]
    config = ModelConfig.from_hf_dict({"model_type": family, **hf}, param_dtype=jnp.float32, dtype=jnp.bfloat16,
                                      remat=remat, attention=attention)
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6, b1=0.9, b2=0.95, eps=1e-8))
    opt_state = jax.jit(optimizer.init)(params)
    seq = prompt + completion
    rng = np.random.default_rng(0)
    batch_arrays = {
        "tokens": jnp.asarray(rng.integers(100, min(1000, config.vocab_size), (batch, seq)), jnp.int32),
        "attention": jnp.ones((batch, seq), bool),
        "completion_mask": jnp.ones((batch, completion), jnp.float32),
        "advantages": jnp.asarray(rng.standard_normal(batch), jnp.float32),
    }
    settings = UpdateSettings(loss_type="bnpo", eps_low=0.2, eps_high=0.2, beta=0.0,
                              num_micro=batch // micro_batch, chunk_size=128, temperature=1.0)
    t0 = time.perf_counter()
    compiled = update.lower(graphdef, optimizer, params, opt_state, batch_arrays, settings).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        params, opt_state, metrics = compiled(params, opt_state, batch_arrays)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt_state, metrics = compiled(params, opt_state, batch_arrays)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / steps
    flops = model_flops(config, batch, seq, completion)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    peer_formula = 6 * n_params * batch * seq + 6 * config.num_layers * config.hidden_size * seq * batch * seq
    stats = jax.devices()[0].memory_stats() or {}
    return dict(micro_batch=micro_batch, remat=remat, attention=attention, batch=batch, seq=seq, completion=completion,
                compile_s=round(compile_s, 1), step_s=round(step_s, 3), tokens_per_s=round(batch * seq / step_s),
                mfu=round(flops / step_s / PEAK_BF16, 3), mfu_peer_formula=round(peer_formula / step_s / PEAK_BF16, 3),
                peak_mem_gb=round(stats.get("peak_bytes_in_use", 0) / 2**30, 1), loss=float(metrics["loss"]),
                grad_norm=float(metrics["grad_norm"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/bench_train.json")
    parser.add_argument("--variants", default="16:full:xla,32:dots_no_batch:xla,32:dots_no_batch:cudnn",
                        help="comma-separated micro_batch:remat:attention")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peer", action="store_true", help="also run the HF transformers peer (32 x 768)")
    args = parser.parse_args()
    peer = None
    if args.peer:  # first, while this process holds no GPU memory yet
        script = Path(__file__).parent / "peers" / "hf_train_bench.py"
        out = subprocess.run([sys.executable, str(script), "32", "768"], capture_output=True, text=True)
        peer = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
        print("peer", json.dumps(peer), flush=True)
    results = []
    for variant in args.variants.split(","):
        micro, remat, attention = variant.split(":")
        try:
            results.append(bench(args.shape, int(micro), remat, attention, args.batch, args.prompt, args.completion,
                                 args.steps))
        except Exception as e:  # an out-of-memory variant is a result, not a crash of the sweep
            results.append(dict(micro_batch=int(micro), remat=remat, attention=attention,
                                error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(json.dumps(results[-1]), flush=True)
    import flax
    import transformers

    payload = dict(command=" ".join(sys.argv), device=str(jax.devices()[0].device_kind), shape=args.shape,
                   versions=dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,
                                 optax=optax.__version__, transformers=transformers.__version__),
                   results=results, peer=peer)
    ok = [r for r in results if "tokens_per_s" in r]
    if peer and "tokens_per_s" in peer and ok:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        payload["best_vs_peer_tokens_per_s"] = round(best["tokens_per_s"] / peer["tokens_per_s"], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
