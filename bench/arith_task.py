"""The speed issue's task, shared by the benches that compare against it (`async_grpo.py`, `vs_trl.py`).

SmolLM2-135M-Instruct on 2-digit `+`/`-` problems ("Compute 37 + 48. Reply with only the final integer, nothing
else."), 4 prompts x 8 samples, <= 32 new tokens, T = 0.7, lr 1e-5 with linear decay to 0 (as TRL's `linear`
schedule), DAPO loss, no KL; no checkpoints, no MLflow, greedy pass@1 before and after only (eval.every=0).

`SPARSE` is the sparse-reward variant: 3-digit sums, where the model starts at ~6% greedy pass@1 and most groups of 8
samples score all zero at first (measured on seed 0: 3 of 4 groups, training reward 0.03 over the first steps).
"""

PRESET = "smollm2-arith"

TASK = [
    "data.operations=[+,-]",
    "data.allow_negative=true",
    "data.prompt_template=Compute {a} {op} {b}. Reply with only the final integer, nothing else.",
    "rollout.prompts_per_step=4",
    "rollout.group_size=8",
    "rollout.max_new_tokens=32",
    "rollout.temperature=0.7",
    "update.lr=1e-5",
    "update.schedule=linear",
    "update.min_lr_ratio=0",
    "algo.loss=dapo",
    "algo.beta=0",
    "eval.every=0",
    "eval.k=0",
    "checkpoint.every=0",
    "tracking.mlflow=false",
]

SPARSE = [*TASK, "data.digits=3", "data.operations=[+]", "data.allow_negative=false"]

TASKS = {"demo": TASK, "sparse": SPARSE}
