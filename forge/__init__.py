"""forgeweave's RL library. `forge.train(...)` (forge/api.py) is the Python entry point; it is imported on first
use, so `import forge` stays light."""

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from forge.api import train

        return train
    raise AttributeError(f"module 'forge' has no attribute {name!r}")
