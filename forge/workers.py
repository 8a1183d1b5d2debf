"""Stage workers: the objects that do a stage's work, wherever they run.

Each worker takes the config sections it reads (and plain values such as the seed; `forge.compose` picks them out
of the run config), builds what it needs from them, keeps it for the whole run (a loaded model, an optimizer,
an ensemble window) and answers method calls with the stage's record. In-process (`forge.stages.LocalStages`)
they are plain objects in the driver; in Ray mode (`flows/ray_exec.py`) each one lives in a Ray actor on the
node Weaver planned for its stage. Nothing here knows which: no Ray, no Prefect.

- `RolloutWorker`: samples (`generate`: completions, or with `env.*` multi-turn episodes, whose environments and
  tools run here) and evaluates (`evaluate`) with the hf backend or a vLLM engine in its own process; receives new
  weights over the weight group (`join_weight_group`, `receive_weights(version)`;
  `forge.weight_group`) or as a dict (`load_weights(weights, version)`) and refuses to sample for another version.
  An hf copy of a LoRA policy is the base with an adapter of the same config, and receives the adapter alone
  (`publishes_adapter`).
- `RewardWorker`: verifiers -> the reward (`reward.aggregate`: weighted, mean, majority vote or the label-free
  ensemble; forge/rewards/aggregate.py) -> group advantages (`score`); with `distill.teacher`, plus the teacher's
  per-token distillation advantage ([N, T]; forge/rewards/teacher.py) from the teacher stage's scores it is given.
- `TeacherWorker`: the teacher stage in a process of its own (Ray mode; in process `forge.stages.LocalStages` holds
  the `Teacher` itself): `logprobs(rollouts)` -> [N, T] (and the [N, T, k] top k with `distill.topk`, which the
  update's loss consumes).
- `TrainerWorker`: one update rank (rank r of a world of N: a torch.distributed group, gloo on CPU, NCCL on GPU,
  with Accelerate inside); `step` trains on the rank's share of a batch; rank 0 hosts the weight group and `send_weights` broadcasts them to the rollout workers (colocated, ipc:
  every rank hosts the group of the rollout workers on its GPU);
  `save` starts a checkpoint (every rank snapshots and writes its own shard, in a background thread by default)
  and `wait_saved` waits for it.

Randomness: a rollout samples with the seed its request carries (derived from (seed, step) by the recipe,
`forge.rollout.base.rollout_seed`), the update seeds its own draws (a LoRA adapter's dropout) from (seed, step, rank)
(`forge.trainer.update_seed`): no worker carries RNG state, so where a worker runs and what else its process did
never changes what it samples.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forge.advantages import group_advantages
from forge.checkpoint import (
    ADAPTER,
    WEIGHTS,
    AsyncCheckpointer,
    SaveReport,
    Snapshot,
    adapter_state,
    assign_weights,
    begin_checkpoint,
    check_finite,
    encode_state,
    host_snapshot,
    load_state,
    room_for,
    write_checkpoint,
    write_model_files,
)
from forge.config import CheckpointConfig, EvalConfig
from forge.distributed import state as dist_state
from forge.env.config import EnvConfig
from forge.evaluate import evaluate
from forge.model_config import ModelConfig
from forge.models import add_lora, default_device, frozen_tensors, is_peft, load_policy
from forge.records import Rollouts, ScoredBatch, TeacherTopK, UpdateStats
from forge.rewards.aggregate import majority_rewards, mean_scores
from forge.rewards.code_judge import count_suspicious
from forge.rewards.config import RewardConfig
from forge.rewards.distill_config import DistillConfig
from forge.rewards.registry import resolve_verifiers
from forge.rewards.score import score_completions, unscored
from forge.rollout import SamplingParams, make_backend
from forge.rollout.config import RolloutConfig
from forge.trainer_config import AlgoConfig, UpdateConfig
from forge.weight_group import FROZEN_SYNC, WeightGroup, WeightPlan, copy_into, fingerprint, make_plan

if TYPE_CHECKING:
    from forge.rewards.teacher import TeacherScores
    from forge.trainer import MicroUpdate

# a rank waits in a collective while the other ranks are still busy (slow micro-batches, a checkpoint)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
QUEUED_SYNC_WAIT = timedelta(days=1)  # asynchronous GRPO: how long a send waits for receivers still generating


def where() -> dict:
    """Where this worker runs: host, pid, the devices and threads it was given."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": torch.get_num_threads(),
        "pool": os.environ.get("FORGEWEAVE_POOL", ""),
        "python": sys.executable,
        # the peak of torch's allocator in this process so far (None where CUDA never started here)
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None,
    }


def _init_process(seed: int, threads: int) -> None:
    threads = int(os.environ.get("FORGEWEAVE_THREADS", "0") or 0) or threads
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


class RolloutWorker:
    """The rollout and evaluate stages over one policy copy (or the trainer's own module, in-process)."""

    def __init__(self, *, model_cfg: ModelConfig, rollout: RolloutConfig, env: EnvConfig, eval: EvalConfig,
                 reward: RewardConfig, seed: int, threads: int = 0, max_staleness: int = 0,
                 answer_column: str = "answer", model=None, tokenizer=None,
                 work_dir: str | Path | None = None):  # fmt: skip
        """`reward`: evaluation's mean reward and the built-in tools' sandbox; `max_staleness`: algo's (whether the
        engine sleeps); `answer_column`: data's (hidden from verifiers with reward.label_free: `hidden_columns`)."""
        self.rollout_cfg, self.env_cfg, self.eval_cfg, self.reward_cfg = rollout, env, eval, reward
        self.seed, self.answer_column = seed, answer_column
        if model is None:
            _init_process(seed, threads)
            # a vLLM engine reads only the config here (its weights arrive by sync): no weight file is read, no
            # host copy of the policy is made (a meta-device model; 30 GB of fp32 at 7B otherwise)
            model, tokenizer = load_policy(model_cfg, seed=seed, weights=rollout.backend != "vllm")
            if publishes_adapter(rollout, model_cfg):  # the syncs carry only the adapter: hold one over the base
                model = add_lora(model, model_cfg.lora)
            model.requires_grad_(False)
            if rollout.backend == "hf":  # a vLLM engine places its own copy
                model = model.to(default_device())
        self.model, self.tokenizer = model, tokenizer
        r = rollout
        self.sleeps = rollout_sleeps(r, max_staleness)
        self.sleep_level = generate_sleep_level(r, max_staleness)  # after a generate: 2 when a sync comes next
        self.backend = make_backend(r.backend, model, tokenizer, autocast_bf16=r.autocast_bf16, rollout=r,
                                    work_dir=Path(work_dir) if work_dir else None, sleep=self.sleeps)  # fmt: skip
        if r.backend == "vllm":  # the engine holds its own copy (received by sync): keep no fp32 policy here
            self.model = None
        self.policy_version = 0
        self._verifiers = None
        self.weight_group: WeightGroup | None = None  # joined in Ray mode (`join_weight_group`)
        self.group_member: dict | None = None  # this actor's place in the weight group, for workers.json
        self._env = None  # multi-turn: (environment factory, tools, chat format), loaded on first use
        self._load_env = functools.partial(_environment, env, model_cfg, reward, r.prompts_per_step * r.group_size)
        if env.enabled:  # its mistakes (a class without reset, an undocumented tool) show at start
            self._env = self._load_env(tokenizer)

    def generate(
        self, prompts: list[str], params: SamplingParams, version: int, rows: list[dict] | None = None
    ) -> Rollouts:
        """params.n completions per prompt from policy `version` (refused if this worker holds another one); with
        `env.*` set, params.n multi-turn episodes per data row of `rows` (`forge.env.episode`)."""
        if version != self.policy_version:
            raise RuntimeError(f"rollout worker holds policy version {self.policy_version}, asked for {version}")
        t0 = time.perf_counter()
        if self.env_cfg.enabled:
            rollouts = self._episodes(rows, params)
        else:
            rollouts = self.backend.generate(prompts, params)
        seconds = time.perf_counter() - t0
        if self.sleeps:  # the update comes next: give it the engine's GPU memory until the weights arrive
            self.backend.sleep(self.sleep_level)
        return dataclasses.replace(rollouts, seconds=seconds)

    def _episodes(self, rows: list[dict] | None, params: SamplingParams) -> Rollouts:
        from forge.env.episode import run_episodes

        assert rows is not None, "multi-turn episodes need the data rows (environment reset(**row))"
        if self._env is None:
            self._env = self._load_env(self.tokenizer)
        factory, functions, fmt = self._env
        return run_episodes(self.backend.generate_ids, self.tokenizer, rows, params, self.env_cfg, fmt, factory,
                            functions, self.policy_version)  # fmt: skip

    def load_weights(self, weights: dict[str, torch.Tensor] | None, version: int) -> float:
        """Sample from `weights` (None: the shared module already holds them) labelled `version`; returns seconds."""
        t0 = time.perf_counter()
        if self.rollout_cfg.backend == "hf":
            if weights is not None:
                assign_weights(self.model, weights, source=f"policy version {version}")
            self.backend.sync_weights(self.model, version)
        else:  # a vLLM engine loads the tensors into its own model
            self.backend.sync_weights(weights, version)
        self.policy_version = version
        return time.perf_counter() - t0

    def join_weight_group(self, rank: int, world: int, address: str, port: int, plan: WeightPlan,
                          local_address: str = "", backend: str = "") -> None:  # fmt: skip
        """Join the weight group hosted by update rank 0 at `address:port` as `rank` (a vLLM engine: its workers as
        `rank`, `rank + 1`, ...); blocks until all have joined. `plan`: the layout of every sync
        (`TrainerWorker.host_weight_group`); `backend`: the group's (`forge.weight_group`; ipc when colocated)."""
        self.group_member = {"rank": rank, "world": world, "address": address, "port": port, "backend": backend}
        if self.weight_group is not None:  # a group rebuilt: the old one is gone with its host
            self.weight_group.close()
            self.weight_group = None
        if self.rollout_cfg.backend != "hf":
            self.backend.join_weight_group(rank, world, address, port, plan, local_address, backend)
            return
        self.weight_group, self.weight_plan = WeightGroup(rank, world, backend), plan
        self.weight_group.connect(address, port, local_address=local_address)
        self.weight_group.check_frozen(plan, self.model.state_dict())  # LoRA: the base the adapter lands on
        self._load_into = copy_into(self.model)

    def receive_weights(self, version: int) -> float:
        """Receive one sync from the weight group, labelled `version` (hf: into the model, in place; vLLM: through
        each worker's `reload_weights`); returns seconds."""
        t0 = time.perf_counter()
        if self.rollout_cfg.backend == "hf":
            self.weight_group.receive(self.weight_plan, self._load_into)  # raises if a tensor arrived corrupted
            self.weight_group.check_loaded(self.weight_plan, self.model.state_dict())  # and if the load did not take
            self.backend.sync_weights(self.model, version)
        else:
            self.backend.receive_weights(version)
        self.policy_version = version
        return time.perf_counter() - t0

    def evaluate(self, rows: list[dict], step: int, version: int, probe: bool = False) -> dict:
        """The eval report of policy `version` on `rows` (greedy pass@1, sampled pass@k, mean reward); `probe`: the
        collapse guard's probe, greedy pass@1 and mean reward only, on all of `rows`."""
        if version != self.policy_version:
            raise RuntimeError(f"rollout worker holds policy version {self.policy_version}, asked for {version}")
        rc = self.reward_cfg
        # mean reward only for the weighted sum: a label-free aggregate scores a completion against its group and
        # the current fit, not alone (and its verifiers, an LLM judge say, would cost as much as the eval)
        if self._verifiers is None and rc.aggregate == "weighted":
            self._verifiers = resolve_verifiers(rc.verifiers, rc)
        ev = dataclasses.replace(self.eval_cfg, k=0, max_problems=len(rows)) if probe else self.eval_cfg
        backend = self.backend
        if self.env_cfg.enabled:  # episodes, as in training
            from forge.env.episode import EpisodeBackend

            backend = EpisodeBackend(self.backend, self.tokenizer, rows, self.env_cfg, self._env)
        hidden = hidden_columns(rc.label_free, self.answer_column)
        report = evaluate(backend, rows, ev, self.rollout_cfg, self._verifiers, rc.weights, seed=self.seed + step,
                          timeout_s=rc.score_timeout_s, reward=rc, hidden=hidden)  # fmt: skip
        if self.sleeps:  # level 1: the next generate samples from these weights
            self.backend.sleep(1)
        report["step"] = step
        return report

    def where(self) -> dict:
        return {**where(), "stage": "rollout", "backend": self.rollout_cfg.backend, "weight_group": self.group_member}

    def close(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
        if self._env is not None:  # an OpenEnv server forgeweave started stops here
            from forge.env.load import close_environment

            close_environment(self._env)
        self.backend.close()


class RewardWorker:
    """The reward stage: per-verifier scores, the aggregated reward (`reward.aggregate`), group advantages."""

    def __init__(self, reward: RewardConfig, *, advantage: str, seed: int, steps: int, prompts_per_step: int,
                 answer_column: str = "answer", train_rows: int = 0, distill: DistillConfig | None = None):  # fmt: skip
        """`advantage`: algo's estimator; `steps`, `prompts_per_step`: the run's, for TRL's trainer_state;
        `answer_column`: data's (hidden from verifiers with reward.label_free: `hidden_columns`); `train_rows`: the training split's size,
        for trainer_state.epoch (0 = unknown: epoch stays 0); `distill`: the distillation section (None: off; on,
        `score` is given the teacher stage's scores)."""
        self.reward_cfg, self.advantage, self.seed, self.answer_column = reward, advantage, seed, answer_column
        self.steps, self.prompts_per_step, self.train_rows = steps, prompts_per_step, train_rows
        self.verifiers = resolve_verifiers(reward.verifiers, reward)
        self.aggregator = None
        if reward.aggregate == "ensemble":
            from forge.rewards.aggregate import EnsembleAggregator

            names = [name for name, _ in self.verifiers]
            self.aggregator = EnsembleAggregator(names, reward.ensemble, seed)
        self.distill_cfg = distill if distill is not None else DistillConfig()

    def score(
        self, rows: list[dict], rollouts: Rollouts, step: int, teacher: TeacherScores | None = None
    ) -> ScoredBatch:
        """Score step `step`'s completions; safe to repeat for the same step (the ensemble replaces its entry).
        `teacher`: the teacher stage's scores of the sampled tokens (`forge.rewards.teacher.Teacher.logprobs`), which
        a run with `distill.teacher` passes: their log-probs become the per-token distillation advantage."""
        g = rollouts.group_size
        result = score_completions(
            self.verifiers,
            self.reward_cfg.weights,
            rollouts.prompts,
            rollouts.texts,
            _columns(rows, g, hidden_columns(self.reward_cfg.label_free, self.answer_column)),
            timeout_s=self.reward_cfg.score_timeout_s,
            raw_prompts=[r["prompt"] for r in rows for _ in range(g)],
            completion_ids=completion_id_lists(rollouts),
            trainer_state=self.trainer_state(step),
            environments=rollouts.episodes.environments if rollouts.episodes is not None else None,
        )
        failed = failed_episodes(rollouts)  # [N]: their environment failed: no verifier's score, reward 0
        if failed.any():
            result = unscored(result, failed)
        rewards, report, extra = result.rewards, None, {}  # [N]: weighted
        aggregate = self.reward_cfg.aggregate
        if self.aggregator is not None:  # label-free: P(correct | the V scores), refit on recent steps
            rewards, report = self.aggregator(result.scores, g, step)
        elif aggregate == "majority":  # the group's own vote on the final answer; the scores are only logged
            rewards = majority_rewards(rollouts.texts, g)
            extra = {"reward/majority_share": float(rewards.mean())}
        elif aggregate == "mean":
            rewards = mean_scores(result.scores)
        if rollouts.episodes is not None and rollouts.episodes.requests:  # agent episodes (env.agent): an agent's
            # return value is its episode's reward (None: the verifiers')
            from forge.env.agent import agent_rewards

            rewards = agent_rewards(rollouts.episodes, rewards)
        if failed.any():
            rewards = rewards.masked_fill(failed, 0.0)
        advantages = group_advantages(rewards, g, self.advantage)  # [N]
        if self.distill_cfg.teacher:  # + weight * the teacher's per-token advantage: [N, T] (or, with its top k, 0)
            advantages, distill = self.distill(advantages, rollouts, teacher)
            extra = {**extra, **distill}
        if "code_exec" in result.names:  # completions that reach for a forgery's tools (they score 0 regardless)
            extra = {**extra, "reward/code_exec/suspicious": float(count_suspicious(rollouts.texts))}
        return ScoredBatch(result.names, result.scores, rewards, advantages, result.failures,
                           verifier_errors=result.errors, verifier_errored=result.errored, reward_metrics=extra,
                           ensemble_report=report)  # fmt: skip

    def distill(self, advantages: torch.Tensor, rollouts: Rollouts, teacher: TeacherScores | None
                ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
        """The [N, T] advantages with the teacher's term (forge/rewards/teacher.py; weight 0 when the teacher's top k
        goes to the loss instead, distill.topk) and `distill/reverse_kl`."""
        from forge.rewards.teacher import distill_advantages

        if teacher is None:
            raise RuntimeError("distill.teacher is set but the reward stage got no teacher scores (the teacher stage)")
        d = self.distill_cfg
        weight = 0.0 if d.topk else d.weight  # 0 * a non-finite log-prob still skips the step
        return distill_advantages(advantages, teacher.logp, rollouts, weight, d.discount)

    def trainer_state(self, step: int):
        """What TRL passes reward functions as `trainer_state`: a transformers TrainerState. While step `step` is
        scored, `step - 1` updates are done (TRL's global_step); epoch = prompts drawn so far / training rows."""
        from transformers import TrainerState

        drawn = (step - 1) * self.prompts_per_step
        epoch = drawn / self.train_rows if self.train_rows else 0.0
        return TrainerState(epoch=epoch, global_step=step - 1, max_steps=self.steps,
                            train_batch_size=self.prompts_per_step)  # fmt: skip

    def state_dict(self) -> dict | None:
        return self.aggregator.state_dict() if self.aggregator is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.aggregator is not None and state is not None:
            self.aggregator.load_state_dict(state)

    def where(self) -> dict:
        return {**where(), "stage": "reward"}

    def close(self) -> None:
        pass


class TeacherWorker:
    """The distillation teacher as a worker of its own (Ray mode: its own actor, on the pool Weaver planned for the
    `teacher` stage): loads `distill.teacher` once and scores each step's sampled tokens."""

    def __init__(self, distill: DistillConfig, model_cfg: ModelConfig, *, batch_size: int, temperature: float,
                 autocast_bf16: bool = False, seed: int = 0, threads: int = 0):  # fmt: skip
        """The teacher's settings (`forge.rewards.teacher.Teacher`); `seed`, `threads`: this process's."""
        from forge.rewards.teacher import Teacher

        _init_process(seed, threads)
        self.teacher = Teacher(distill, model_cfg, batch_size=batch_size, temperature=temperature,
                               autocast_bf16=autocast_bf16)  # fmt: skip

    def logprobs(self, rollouts: Rollouts) -> TeacherScores:
        """The teacher's log-prob of every completion token, and its top k (`forge.rewards.teacher.Teacher`)."""
        return self.teacher.logprobs(rollouts)

    def where(self) -> dict:
        return {**where(), "stage": "teacher", "device": str(self.teacher.device)}

    def close(self) -> None:
        pass


class TrainerWorker:
    """One update rank: the policy, AdamW and the LR controller (`forge.trainer.Trainer`) for the whole run.

    With world > 1 the rank joins a torch.distributed group at `master_addr:master_port` (Accelerate reads RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT and forms it: gloo on CPU, NCCL on GPU) and DDP/FSDP averages gradients.
    `local_rank` is the rank's index among the GPUs this process sees (0 when it was given only its own GPU).
    """

    def __init__(self, *, model_cfg: ModelConfig, update: UpdateConfig, algo: AlgoConfig, rollout: RolloutConfig,
                 checkpoint: CheckpointConfig, seed: int, steps: int, threads: int = 0, model=None, tokenizer=None,
                 rank: int = 0, world: int = 1, master_addr: str = "", master_port: int = 0, local_rank: int = 0,
                 micro_update: MicroUpdate | None = None):  # fmt: skip
        """`rollout`: the engines' dtype (`publish_dtype`), the sampling temperature and length cap the loss uses;
        `steps`: the run's (the LR schedule's length); `micro_update`: the recipe's update math for one micro-batch
        (`forge.trainer.Trainer`)."""
        from forge.trainer import Trainer, make_accelerator

        self.rank, self.world, self.checkpoint_cfg = rank, world, checkpoint
        self.publish = functools.partial(publish_dtype, rollout, model_cfg.dtype)
        self.adapter_only = publishes_adapter(rollout, model_cfg)  # LoRA into hf copies: the syncs carry the adapter
        self.weight_check = rollout.weight_check  # the weight group's integrity check (its receivers follow it)
        self.queued_syncs = algo.max_staleness > 0  # asynchronous: a sync's receives wait behind generate calls
        accelerator = None
        if world > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                              LOCAL_WORLD_SIZE="1", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))  # fmt: skip
            accelerator = make_accelerator(timeout=COLLECTIVE_TIMEOUT)
            _check_group(accelerator, world)
        if model is None:
            _init_process(seed, threads)
            model, tokenizer = load_policy(
                model_cfg, seed=seed, weights=loads_weights(update.strategy, rank, world), trainable=True
            )
        self.tokenizer = tokenizer
        # LoRA needs no copy: the reference is the policy with its adapter disabled (`Trainer._reference_logprobs`)
        copy_ref = algo.beta > 0 and not is_peft(model)
        ref = copy.deepcopy(model).eval().requires_grad_(False) if copy_ref else None
        self.trainer = Trainer(model, update, algo, steps, seed=seed, temperature=rollout.temperature,
                               max_new_tokens=rollout.max_new_tokens, ref_model=ref, accelerator=accelerator,
                               micro_update=micro_update)  # fmt: skip
        self.saver = AsyncCheckpointer()
        _torch_optimizer(self.trainer.optimizer).register_step_pre_hook(lambda *_: self.saver.wait_staged())
        # the checkpoint writer's DCP collectives run on a gloo group of their own, so they never interleave with
        # training's on the default group; made now, while every rank is here (None with one process)
        self.checkpoint_group = torch.distributed.new_group(backend="gloo") if world > 1 else None
        self.weight_group: WeightGroup | None = None  # Ray mode: rank 0's, any rank's under ipc (`host_weight_group`)
        self.group_member: dict | None = None  # its place in the group it hosts (rank, world, ...), for workers.json
        self.releases = releases_memory(torch.cuda.is_available(), os.environ.get("FORGEWEAVE_COLOCATED", ""))

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    def step(self, rollouts: Rollouts, advantages: torch.Tensor, teacher: TeacherTopK | None = None) -> UpdateStats:
        """Train on this rank's share of the step (the weights then go out through the weight group, `send_weights`;
        in process the rollout worker shares the module). Colocated with a rollout engine on CUDA (`releases`), the
        rank then releases its gradients and cached blocks (`release_memory`) before the engine wakes for the sync."""
        stats = self.trainer.update(rollouts, advantages, teacher)
        if self.releases:
            release_memory(self.trainer.optimizer)
        return stats

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights on CPU (rank 0; None on the others) in the dtype the rollout engines run in
        (`publish_dtype`: bf16 for a vLLM engine on CUDA, half the bytes to move). Every rank must call it under
        FSDP."""
        full = self.trainer.full_weights()
        if self.rank != 0:
            return None
        dtype = self.publish(next(iter(full.values())).dtype)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}

    def host_weight_group(self, address: str, world: int, backend: str = "") -> tuple[WeightPlan, int]:
        """Open a weight group's store on `address` for `world` members (this rank and the rollout engines' workers
        it feeds; `backend`: `forge.weight_group`'s, '' = gloo/NCCL, ipc when colocated); returns (the plan of what
        each sync sends, the port). `connect_weight_group` next. Rank 0 hosts the broadcast group; under ipc any rank
        hosts the group of the engines on its own GPU (each rank holds the full weights at a publish)."""
        assert self.rank == 0 or backend == "ipc", "only update rank 0 hosts a broadcast weight group"
        # asynchronous, a receiver begins a sync only after the generate calls queued before it: the send waits for
        # that without a limit of its own (a receiver that dies is the driver's to see: it closes the group)
        ready = QUEUED_SYNC_WAIT if self.queued_syncs else None
        self.weight_group = WeightGroup(0, world, backend, check=self.weight_check, ready_timeout=ready)
        shapes = self.trainer.publish_shapes(self.adapter_only)
        self.weight_plan = make_plan(shapes, self.publish(shapes[0][1]))
        if self.adapter_only:  # the receivers hold the base already: they check it is this one when they join
            frozen = fingerprint(frozen_tensors(self.trainer.unwrapped), FROZEN_SYNC)
            self.weight_plan = dataclasses.replace(self.weight_plan, frozen=tuple(frozen.items()))
        port = self.weight_group.host(address)
        self.group_member = {"rank": 0, "world": world, "address": address, "port": port, "backend": backend}
        return self.weight_plan, port

    def connect_weight_group(self, address: str, port: int) -> None:
        """The hosting rank: wait for every member of its weight group (`RolloutWorker.join_weight_group`) to join."""
        self.weight_group.connect(address, port, local_address=address)

    def send_weights(self) -> int:
        """Send the current weights through this rank's weight group, if it hosts one (rank 0; under ipc every rank
        with engines on its GPU); returns the bytes sent (0 without a group). Under FSDP every rank gathers each
        parameter in turn (a collective), so a rank without a group still drains the stream; a DDP rank without one
        does nothing (no host copy). DDP ranks hold identical full replicas, so any rank's stream is the policy."""
        if self.weight_group is not None:
            return self.weight_group.send(self.weight_plan, self.trainer.publish_tensors(self.adapter_only))
        if self.trainer.fsdp:
            for _ in self.trainer.publish_tensors():
                pass
        return 0

    def save(self, root: str, step: int, payload: dict, eval_score: float | None) -> None:
        """Start checkpoint `step` under `root` with the loop's `payload` (sampler, evals, ...) beside the trainer
        state; every rank must call it. Waits for the save in flight first (at most one), snapshots (a host copy
        when `checkpoint.async_save`) and writes in a background thread (async) or before returning."""
        self.saver.wait()
        snap = self._snapshot(step, payload, eval_score)
        check_finite(snap, Path(root), self.checkpoint_group)  # a NaN never reaches a checkpoint (nor `latest`)
        tmp = begin_checkpoint(Path(root), step, self.rank)
        if self.rank == 0:
            with room_for(snap, tmp):  # a full disk here too is one line and leaves no partial directory
                write_model_files(tmp, self.trainer.unwrapped, self.tokenizer)
        write = functools.partial(write_checkpoint, tmp=tmp, rank=self.rank, group=self.checkpoint_group)
        if self.checkpoint_cfg.async_save:  # copy in the background too: see AsyncCheckpointer
            self.saver.submit(functools.partial(host_snapshot, snap), write)
        else:
            self.saver.run(host_snapshot(snap) if self.trainer.accelerator.device.type != "cpu" else snap, write)

    def wait_saved(self) -> SaveReport | None:
        """Wait for the save in flight: rank 0's report (None elsewhere, or when there was none); raises the error
        of a failed save (and keeps raising it)."""
        return self.saver.wait()

    def _snapshot(self, step: int, payload: dict, eval_score: float | None) -> Snapshot:
        """This rank's part of checkpoint `step`: its DCP tensors (FSDP: its shards; DDP: rank 0 holds them all,
        the replicas the others hold are the same) and the HF weights (one process, tied copies once), both live
        (`host_snapshot` copies them), and rank 0's state as JSON + tensor copies."""
        model, file = self.trainer.unwrapped, WEIGHTS
        lora = is_peft(model)  # only the adapter is saved (rank 0: under DDP every rank holds all of it)
        hf = not lora and self.world == 1 and self.checkpoint_cfg.hf_model
        shards, plain = self.trainer.checkpoint_tensors(with_model=not hf and not lora)
        if self.rank != 0 and not self.trainer.fsdp:  # DDP: every rank holds the same weights and AdamW moments;
            shards = {}  # rank 0's are the checkpoint, so no other rank copies them to host (or writes them)
        weights = None
        if lora:
            weights, file = (adapter_state(model) if self.rank == 0 else None), ADAPTER
        elif hf:
            unique = dist_state.unique_names(model)
            weights = {k: v for k, v in self.trainer.full_weights().items() if k in unique}
        state = {**payload, "trainer": plain, "step": step, "eval_score": eval_score} if self.rank == 0 else {}
        return Snapshot(step, shards, weights, *encode_state(state), eval_score, self.world, file)

    def restore(self, ckpt: str) -> int:
        """Weights and trainer state from checkpoint directory `ckpt`; returns the restored policy version."""
        self.trainer.restore(Path(ckpt), load_state(Path(ckpt))["trainer"])
        return self.trainer.policy_version

    def where(self) -> dict:
        return {**where(), "stage": "update", "rank": self.rank, "world": self.world,
                "weight_group": self.group_member}  # fmt: skip

    def close(self) -> None:
        if self.weight_group is not None:
            self.weight_group.close()
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def loads_weights(strategy: str, rank: int, world: int) -> bool:
    """Whether update rank `rank` reads the policy's weights: under FSDP only rank 0 does (the others build the
    model on the meta device and receive their shards from it; the reference model, algo.beta > 0, likewise)."""
    return rank == 0 or world == 1 or strategy != "fsdp"


def publishes_adapter(rollout: RolloutConfig, model_cfg: ModelConfig) -> bool:
    """Whether a weight sync carries only the LoRA adapter (`model.lora.rank` > 0): into hf rollout copies, which load
    the same base and an adapter of the same config (`RolloutWorker`) and so compute exactly what the trainer's peft
    module does. A vLLM engine gets the merged weights, one tensor at a time (`forge.trainer.Trainer.publish_tensors`):
    vLLM 0.32 loads an adapter only from a directory (`LoRARequest.lora_path`), which the weight group never writes.

    >>> from forge.model_config import LoraConfig
    >>> lora = ModelConfig(lora=LoraConfig(rank=8))
    >>> publishes_adapter(RolloutConfig(), lora), publishes_adapter(RolloutConfig(backend="vllm"), lora)
    (True, False)
    """
    return model_cfg.lora.rank > 0 and rollout.backend == "hf"


def publish_dtype(rollout: RolloutConfig, model_dtype: str, trainer_dtype: torch.dtype) -> torch.dtype:
    """The dtype weights are published in: a vLLM engine's (`forge.rollout.vllm.engine_dtype`; `model_dtype`:
    model.dtype), else the trainer's (hf copies hold the policy's own dtype)."""
    if rollout.backend != "vllm":
        return trainer_dtype
    from forge.rollout.vllm import engine_dtype

    return engine_dtype(rollout, getattr(torch, model_dtype), torch.cuda.is_available())


def rollout_sleeps(rollout: RolloutConfig, max_staleness: int) -> bool:
    """Whether this process's vLLM engine sleeps during the update (`forge.rollout.vllm.wants_sleep`)."""
    if rollout.backend != "vllm":
        return False
    from forge.rollout.vllm import wants_sleep

    return wants_sleep(rollout, max_staleness, torch.cuda.is_available(), os.environ.get("FORGEWEAVE_COLOCATED", ""))


def generate_sleep_level(rollout: RolloutConfig, max_staleness: int) -> int:
    """The sleep level of this process's vLLM engine after a generate (`forge.rollout.vllm.sleep_level`)."""
    if rollout.backend != "vllm":
        return 1
    from forge.rollout.vllm import sleep_level

    return sleep_level(max_staleness, os.environ.get("FORGEWEAVE_COLOCATED", ""))


def _environment(env: EnvConfig, model_cfg: ModelConfig, reward: RewardConfig, episodes: int, tok) -> tuple:
    """Multi-turn: (environment factory, tools, chat format) (`forge.env.load.load_environment`)."""
    from forge.env.load import load_environment

    return load_environment(env, model_cfg, reward.code_exec, episodes, tok)


def releases_memory(cuda: bool, colocated: str) -> bool:
    """Whether an update rank gives back its gradients and its allocator's cached blocks after each step: on CUDA
    when the plan put a rollout engine on its GPU (`colocated`: $FORGEWEAVE_COLOCATED, set by weaver.apply), which
    wakes into that memory for the sync right after.

    >>> releases_memory(True, "rollout,evaluate"), releases_memory(True, ""), releases_memory(False, "rollout")
    (True, False, False)
    """
    return cuda and "rollout" in colocated.split(",")


def release_memory(optimizer) -> None:
    """Drop the gradients (set to None, not zeroed: their memory goes) and then return the CUDA caching allocator's
    unused blocks to the driver, so a colocated engine waking next finds them free."""
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch optimizer


def _check_group(accelerator, world: int) -> None:
    """Refuse to train unless this rank is one of `world` synchronised ranks: ranks that each train alone (the
    silent Accelerate CPU pitfall) would diverge without a warning."""
    dist = torch.distributed
    if accelerator.num_processes != world or not dist.is_initialized():
        raise RuntimeError(f"update rank sees {accelerator.num_processes} of {world} processes: they are not one group")
    ones = torch.ones(1, device=accelerator.device)
    dist.all_reduce(ones)
    assert int(ones.item()) == world, f"all_reduce over {world} ranks gave {ones.item()}"


def hidden_columns(label_free: bool, answer_column: str) -> tuple[str, ...]:
    """The data columns reward verifiers never get: with reward.label_free, the answer under both its names
    (`answer_column`: data's)."""
    return ("answer", answer_column) if label_free else ()


def completion_id_lists(rollouts: Rollouts) -> list[list[int]]:
    """Each completion's sampled token ids (eos included when sampled), padding dropped: TRL's `completion_ids`."""
    mask = rollouts.completion_mask.bool()  # [N, T]
    return [ids[m].tolist() for ids, m in zip(rollouts.completion_ids.cpu(), mask.cpu(), strict=True)]


def failed_episodes(rollouts: Rollouts) -> torch.Tensor:
    """[N] bool: the episodes whose environment failed (all False for single-turn rollouts)."""
    failures = rollouts.episodes.failures if rollouts.episodes is not None else []
    return torch.tensor([bool(f) for f in failures] or [False] * rollouts.num_completions, dtype=torch.bool)


def _columns(rows: list[dict], group_size: int, hidden: tuple[str, ...] = ()) -> dict[str, list]:
    """Data columns repeated G times so each completion sees its prompt's reference values."""
    keys = [k for k in rows[0] if k not in ("prompt", "model_input", *hidden)]
    return {k: [r[k] for r in rows for _ in range(group_size)] for k in keys}
