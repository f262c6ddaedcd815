"""The compile-only TPU table of docs/tpu.md: the paper's ring3 and pair configs on v5e-8/16, v5p-8 and v6e-8, shared
and partitioned placement, compiled by libtpu on this (CPU) host without weights (`corl_jax.compile_check`).

    python experiments/bench/tpu_compile_table.py [--topologies=v5e-8,v5e-16,v5p-8,v6e-8] [--prompt_len=512]
        [--out=experiments/results/tpu_compile_check.json]

Every agent's mesh is fully sharded (fsdp over all of its chips: the paper models' fp32 weights and AdamW moments do
not fit a v5e/v6e chip replicated). Prints a markdown table and saves the reports as JSON (command, versions).
"""

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CONFIGS = ("ring3", "pair_different_family", "pair_same_family")


def load(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="v5e-8,v5e-16,v5p-8,v6e-8")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--prompt_len", type=int, default=512)
    parser.add_argument("--out", default="experiments/results/tpu_compile_check.json")
    args = parser.parse_args()

    import jax

    from corl_jax import compile_check

    cache, reports, rows = {}, [], []
    start = time.time()
    for topology in args.topologies.split(","):
        chips = compile_check.TOPOLOGIES[topology].chips
        for name in args.configs.split(","):
            for placement in ("shared", "partitioned"):
                config = load(name)
                per_agent = chips if placement == "shared" else chips // len(config.agents)
                if placement == "partitioned" and chips % len(config.agents):
                    rows.append(f"| {name} | {topology} | {placement} | – | – | – | not possible: {chips} chips "
                                f"do not split among {len(config.agents)} agents |")
                    continue
                config.mesh.update(data=1, fsdp=per_agent, tensor=1)
                t0 = time.time()
                report = compile_check.check(config, topology, placement, args.prompt_len, cache)
                report["config"] = name
                reports.append(report)
                print(compile_check.format_report(report), f"({time.time() - t0:.0f} s)", flush=True)
                gib = lambda b: f"{b / 2 ** 30:.1f}"  # noqa: E731
                peaks = ", ".join(f"{a}: {gib(r['peak_per_chip'])}" for a, r in report["agents"].items())
                fits = "yes" if all(r["fits"] for r in report["agents"].values()) else "**no**"
                rows.append(f"| {name} | {topology} | {placement} | fsdp={per_agent} | "
                            f"{config.grpo.micro_batch_size} | {peaks} | {fits} "
                            f"({compile_check.TOPOLOGIES[topology].hbm_gib} GiB) |")
    table = ["| config | slice | placement | mesh per agent | micro-batch | peak GiB per chip | fits |",
             "|---|---|---|---|---|---|---|", *rows]
    print("\n".join(table))
    result = {"command": " ".join([sys.executable, *sys.argv]), "device": "compile-only TPU devices (libtpu) on "
              + platform.node(), "versions": {"jax": jax.__version__, "libtpu": _libtpu_version()},
              "prompt_len": args.prompt_len, "seconds": round(time.time() - start), "table": table,
              "reports": reports}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def _libtpu_version():
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return os.environ.get("TPU_LIBRARY_PATH", "unknown")


if __name__ == "__main__":
    main()
