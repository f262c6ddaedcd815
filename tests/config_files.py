"""The experiment files under configs/, loaded as `python -m corl_jax.train --config=configs/<name>.py:<variant>`
would load them."""

import importlib.util
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def load_config(name: str, variant: str = "tiny"):
    spec = importlib.util.spec_from_file_location(name, CONFIG_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)
