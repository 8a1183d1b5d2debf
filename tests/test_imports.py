"""forge must import where only torch / transformers / accelerate / safetensors / numpy exist (e.g. a GPU box, or
.venv-vllm for an engine actor): importing it must not pull in the orchestration (Prefect, Ray), tracking or UI
packages, nor the packages above it."""

import subprocess
import sys

CHECK = """
import sys
import forge.recipes.grpo, forge.rewards.ensemble, forge.rewards.aggregate, forge.rewards.judges, forge.trainer
import forge.workers, forge.stages, forge.rollout.vllm  # the Ray actors' workers: vllm is imported only by an engine
import forge.tracking_mlflow, forge.outbox  # mlflow itself is imported only when records are sent
import forge.tracking_tensorboard, forge.tracking_wandb  # tensorboard / wandb only when a tracker sends
import forge.api  # forge.train: datasets is imported only when a dataset object is given
bad = sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "mlflow", "streamlit", "pyarrow", "flows",
                                                       "weaver", "dashboard", "pandas", "ray", "vllm",
                                                       "tensorboard", "wandb", "datasets", "math_verify"})
print("imported:", ",".join(bad) or "none")
"""


def test_forge_imports_without_orchestration_packages():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "imported: none"
