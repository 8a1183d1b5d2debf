"""Ray execution (`orchestration.execution: ray`): every stage in a long-lived actor on the pool Weaver planned.

`RayStages` implements `forge.stages.Stages` over actors (`flows.ray_actor.StageActor`, one per process), so the
loop in `forge.recipes.grpo` is the same as in-process; the Prefect flow still turns each stage call into a task
run. Started once per run (and again after a recovery), each actor loads its model once:

- update: N rank actors (`forge.workers.TrainerWorker`), rank r on the node of the plan's r-th process; they form
  one torch.distributed group (gloo on CPU, NCCL on GPU) at an address and free port on rank 0's node;
- rollout: `rollout.replicas` actors (`RolloutWorker`: hf, or a vLLM engine run by `.venv-vllm`'s python through
  the actor's `runtime_env.py_executable`); a step's prompts are split between them in whole groups by measured
  tokens/s (weaver's `ThroughputBalancer`), each share with its data rows and its first row in the step, so
  multi-turn episodes run in the actors (environments and tools there) and sample what one call would;
  evaluation runs on replica 0 (Weaver: evaluate runs in rollout);
- reward: one actor (`RewardWorker`) on reward's pool;
- teacher (with `distill.teacher`, on-policy distillation): one actor (`TeacherWorker`) on the teacher stage's pool
  (Weaver: beside update by default, or a cpu pool reserved for it); the loop's teacher stage: it scores the rollouts
  (read by reference), its [N, T] log-probs go to the reward actor and its top k to the update ranks.

Placement: each pool's nodes offer the custom resource `pool:<name>` (`ray start --resources '{"pool:gen": 1}'`)
and every actor asks for a sliver of its pool's (`weaver.apply.actor_specs`) and for its share of the pool's CPUs,
in the run's placement group, whose bundles hold the GPUs the plan gives each gpu pool (`flows.ray_reserve`: a
second run on the cluster waits for them, then stops with one line, and never shares a GPU); the actor sees the
GPUs Ray reserved, the plan's devices mapped onto them in order, as CUDA_VISIBLE_DEVICES set before torch starts,
and the plan's thread count. Bundles are spread over their pool's nodes (`SPREAD`), so rollout replicas are.

Weights move once per step through the weight group (`forge.weight_group`, started with the actors): update rank 0
hosts it, rollout actor i joins as rank 1 + i*TP (colocated, `rollout.weight_transport` ipc: one group per GPU, each
update rank hosting one for the rollout actors on its own GPU; `weaver.apply.weight_transport` says which); the
driver submits the receives, then the sends (`flows.ray_sync.WeightSync`, the one component that does it), and only
the plan (names, shapes, bucket layout) crosses Ray: the object store carries no weights (bench/weight_sync.py keeps
the object-store path as its baseline). The rollouts stay where the rollout actor put
them (several replicas' parts are merged and put once); the reward actor and the update ranks read that copy, and
the advantages go by `ray.put`.

Faults: an actor that dies surfaces as `forge.stages.WorkerLost`, on which the loop rebuilds these stages (and so
the weight group, on a new port) and resumes from the last checkpoint. Results are taken as they finish, so an
engine lost in a sync ends it at once, not after the group's timeout that its peers in the broadcast would wait for.
A lost node is that for every actor on it (and an object whose only copy was there); the rebuilt actors go to the
pool's nodes left (rollout replicas are spread over a pool's nodes), and a pool with no live node left stops the run
with one line naming it and its dead node, to be continued with --resume.
Actors are owned by the driver (not detached) and killed by `close()` with the placement group, so none outlives
the run; the private Ray instance (`ray_session` without `orchestration.ray_address`) binds 127.0.0.1, has the
object store the run needs (`flows.planning.object_store_bytes`) and is shut down at the end. It is the user's
alone: it authenticates with a token of its own, kept in a 0600 file, and its temp dir (where Ray makes its session,
socket and log folders world-writable, 0777) lies in a 0700 directory, not in the shared /tmp/ray; neither is
~/.ray/auth_token (which Ray would otherwise write 0644) made or read. Its processes (GCS, raylet, and so every actor
and whatever an actor starts: sandboxes, environment servers) never see the stack's credentials (`flows.stack.AUTH_VARS`
are left out of the environment ray.init starts them with): only the driver talks to Prefect and MLflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

import forge
from flows.planning import object_store_bytes
from flows.ray_actor import StageActor
from flows.ray_reserve import Reservation, reserve
from flows.ray_sync import WeightSync
from forge.checkpoint import SaveReport
from forge.config import RunConfig
from forge.data import train_row_count
from forge.env.openenv import SERVER_PYTHON, replica_sessions
from forge.errors import UserError
from forge.models import load_tokenizer
from forge.records import RolloutRequest, Rollouts, ScoredBatch, UpdateStats
from forge.rewards.teacher import TeacherScores
from forge.rollout.base import SamplingParams, concat_rollouts
from forge.stages import WorkerLost
from forge.weight_group import SECRET_ENV
from weaver.apply import (
    ActorSpec,
    WeightRoutes,
    actor_specs,
    driver_env,
    pool_resource,
    ray_pool_cpus,
    weight_transport,
    with_ray_cpus,
)
from weaver.balance import ThroughputBalancer
from weaver.errors import PlanError
from weaver.plan import Plan

if TYPE_CHECKING:
    from forge.trainer import MicroUpdate

REPO = Path(forge.__file__).resolve().parent.parent
_private = False  # a private Ray instance (`ray_session`) is live: its runs also lock their GPUs on this host


@contextlib.contextmanager
def ray_session(cfg: RunConfig, plan: dict, run_name: str):
    """Connect to orchestration.ray_address, or start a private local Ray (127.0.0.1) whose one node offers every
    pool, with the object store the run needs; a watchdog (`flows.reaper`) stops what it started should this process
    be killed."""
    global _private
    if ray.is_initialized():  # a caller (a test, a notebook) already connected: use that cluster as it is
        yield
        return
    address = cfg.orchestration.ray_address
    kwargs = {"namespace": f"forgeweave-{run_name}", "log_to_driver": False, "configure_logging": False}
    reaper, saved_env = None, None
    if address:
        ray.init(address=address, **kwargs)
    else:
        pools = {pool_resource(p["name"]): 1000.0 for p in plan.get("pools", [])}
        private = private_ray_dir()
        saved_env = _use_token(private / TOKEN_FILE)
        try:  # "local": a new private instance even where `ray start` (e.g. `forgeweave up`) left a cluster behind
            with _without_credentials():
                ray.init(address="local", num_cpus=max(1, os.cpu_count() or 1), resources=pools,
                         include_dashboard=False, object_store_memory=object_store_bytes(cfg),
                         _node_ip_address="127.0.0.1", _temp_dir=str(private / "ray"), **kwargs)  # fmt: skip
        except BaseException:
            _forget_token(private, saved_env)
            raise
        _private = True
        reaper = subprocess.Popen([sys.executable, "-m", "flows.reaper", "--watch", str(os.getpid())],
                                  cwd=REPO, start_new_session=True)  # fmt: skip
    try:
        yield
    finally:
        _private = False
        try:
            ray.shutdown()
        finally:  # the watchdog goes even if the shutdown fails (it would then kill what is left, as on SIGKILL)
            if reaper is not None:
                reaper.terminate()
                reaper.wait(timeout=10)
            if saved_env is not None:
                _forget_token(private, saved_env)


TOKEN_FILE = "auth_token"


def private_ray_dir() -> Path:
    """A new 0700 directory for a private Ray instance: its token file (0600, made here) and its temp dir. Under the
    system's temp dir (a short path: Ray's socket paths there must fit in 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="fw-ray-"))  # mkdtemp: 0700, a name nobody could have taken before
    fd = os.open(root / TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return root


def _use_token(path: Path) -> dict[str, str | None]:
    """Point Ray at the token in `path` for the next ray.init (the GCS, raylet and workers it starts inherit this
    environment; ray.init turns token auth on for a new local cluster unless RAY_AUTH_MODE says otherwise). Returns
    what it replaced. Ray's loader caches one token per process: the cache is reset."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    _reset_token_cache()
    return saved


def _forget_token(private: Path, saved: dict[str, str | None]) -> None:
    """After the private instance: its token file goes (its logs stay, as they did in /tmp/ray) and the environment
    is as it was, so a later ray.init of this process finds the user's token, not a deleted file."""
    (private / TOKEN_FILE).unlink(missing_ok=True)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _reset_token_cache()


@contextlib.contextmanager
def _without_credentials():
    """The block (ray.init: the processes it starts inherit this environment) runs without the stack's credentials
    in the environment; this process has them back afterwards."""
    from flows.stack import AUTH_VARS

    held = {k: os.environ.pop(k) for k in AUTH_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(held)


def _reset_token_cache() -> None:
    from ray._raylet import AuthenticationTokenLoader

    AuthenticationTokenLoader.instance().reset_cache()


class RayStages:
    """`forge.stages.Stages` over Ray actors placed by Weaver's plan. Needs `ray_session` (or ray.init) first."""

    def __init__(self, cfg: RunConfig, run_dir: Path, plan: dict | None, micro_update: MicroUpdate):
        """`micro_update`: the recipe's update math (`forge.recipes.grpo.update_micro_batch`), which each update rank
        actor receives by reference (its module is importable there)."""
        if plan is None:
            raise UserError("Ray execution needs Weaver's plan (flows.planning.plan_run)")
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.plan = Plan.from_dict(plan)
        cores = {p["name"]: int(p.get("cpu_cores", 1)) for p in plan.get("pools", [])}
        self.actors: dict[str, list] = {}
        self._started: dict[int, list[tuple[int, ray.ObjectRef]]] = {}  # step -> prefetched generate calls
        self._stored: tuple[Rollouts, ray.ObjectRef] | None = None  # the last rollouts and their object-store copy
        self.places: dict[str, list[dict]] = {}  # stage -> each actor's `where` at start (its node's address)
        self.reservation: Reservation | None = None
        self.sync: WeightSync | None = None  # once every actor has started
        self.pad_id = load_tokenizer(cfg.model).pad_token_id
        self.distills = _has_teacher(cfg, self.plan)  # a teacher actor of its own
        _check_pools(self.plan, self.run_dir)
        os.environ[SECRET_ENV] = secrets.token_hex(32)  # this run's weight-group secret: every actor's environment
        try:
            self.reservation = self._reserve(cores)
            routes = self._routes()
            self._start_trainers(self.reservation.of("update"), micro_update)
            self._start_rollouts(self.reservation.of("rollout"), cores)
            self._start_scorers(train_row_count(run_dir))
            self.balancer = ThroughputBalancer(len(self.actors["rollout"]))
            tp = cfg.rollout.tensor_parallel_size if cfg.rollout.backend == "vllm" else 1  # ranks per engine
            self.sync = WeightSync(routes, self.actors["update"], self.actors["rollout"], self._get, tp)
            self.sync.start(self.places)
            self.sync.publish(0)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ start

    @property
    def policy_version(self) -> int:
        """The version the rollout actors hold (or will, once the syncs queued behind their generates land)."""
        return self.sync.version

    def _reserve(self, cores: dict[str, int]) -> Reservation:
        """The run's placement group for every process it starts (`flows.ray_reserve`): each asks for its share of
        its pool's CPUs (what the pool declares, at most what its nodes have) and the GPUs the plan gives it."""
        specs = [*actor_specs(self.plan, "update", cores), *self._rollout_specs(cores),
                 actor_specs(self.plan, "reward", cores)[0]]  # fmt: skip
        if self.distills:
            specs.append(actor_specs(self.plan, "teacher", cores)[0])
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        specs = with_ray_cpus(specs, ray_pool_cpus({s.pool: cores.get(s.pool, 1) for s in specs}, nodes))
        name = f"forgeweave:{self.run_dir.name}:{os.getpid()}:{time.time_ns() % 10**9}"  # unique on the cluster
        return reserve(specs, name, self.cfg.orchestration.reserve_timeout_s, lock_host_gpus=_private)

    def _actor(self, spec: ActorSpec, stage: str, python: str = ""):
        env = actor_env(dict(os.environ), spec.env, python)
        runtime_env: dict = {"env_vars": env}
        if python:  # another venv (vLLM's): its own packages plus this checkout of forgeweave
            runtime_env["py_executable"] = python
        assert self.reservation is not None
        actor = StageActor.options(num_cpus=spec.cpus, resources=spec.resources, runtime_env=runtime_env,
                                   scheduling_strategy=self.reservation.strategy(spec)).remote(env)  # fmt: skip
        self.actors.setdefault(stage, []).append(actor)
        return actor

    def _start_trainers(self, specs: list[ActorSpec], micro_update: MicroUpdate) -> None:
        world = self.cfg.update.num_processes or len(specs)
        if world != len(specs):
            raise UserError(f"update.num_processes={world}, but Weaver planned {len(specs)} update processes")
        ranks = [self._actor(s, "update") for s in specs]
        addr, port = self._get([ranks[0].rendezvous.remote()], "update")[0] if world > 1 else ("", 0)
        starts = [a.start.remote("update", self.cfg, rank=r, world=world, master_addr=addr, master_port=port,
                                 micro_update=micro_update) for r, a in enumerate(ranks)]  # fmt: skip
        self.places["update"] = self._get(starts, "update")

    def _start_scorers(self, train_rows: int) -> None:
        """The reward actor and, distilling, the teacher actor, started together: each loads what it needs at the
        same time."""
        self.reward_actor = self._actor(self.reservation.of("reward")[0], "reward")
        starts = {"reward": self.reward_actor.start.remote("reward", self.cfg, train_rows)}
        if self.distills:
            self.teacher_actor = self._actor(self.reservation.of("teacher")[0], "teacher")
            starts["teacher"] = self.teacher_actor.start.remote("teacher", self.cfg)
        for stage, ref in starts.items():
            self.places[stage] = self._get([ref], stage)

    def _rollout_specs(self, cores: dict[str, int]) -> list[ActorSpec]:
        r = self.cfg.rollout
        tp = r.tensor_parallel_size if r.backend == "vllm" else 1
        specs = actor_specs(
            self.plan, "rollout", cores, per_process_devices=tp if self.plan.for_stage("rollout").kind == "gpu" else 1
        )
        return specs[: r.replicas]

    def _start_rollouts(self, specs: list[ActorSpec], cores: dict[str, int]) -> None:
        r = self.cfg.rollout
        python = ""
        if r.backend == "vllm":
            from forge.rollout.vllm import engine_env, vllm_python

            python = str(vllm_python(r.vllm.python))
        for s in specs:
            if python:
                s = dataclasses.replace(s, env={**s.env, **engine_env(r, s.index, list(range(cores.get(s.pool, 1)))),
                                                SERVER_PYTHON: sys.executable})  # fmt: skip
            self._actor(s, "rollout", python)
        work, cfg = str(self.run_dir / "rollout"), self._rollout_cfg(len(specs))
        starts = [a.start.remote("rollout", cfg, work_dir=work) for a in self.actors["rollout"]]
        self.places["rollout"] = self._get(starts, "rollout", timeout=r.vllm.start_timeout_s)

    def _rollout_cfg(self, replicas: int) -> RunConfig:
        """The rollout actors' config: the run's, with each actor's share of a shared OpenEnv server's sessions."""
        if not self.cfg.env.openenv.url or replicas == 1:
            return self.cfg
        episodes = self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size
        share = replica_sessions(self.cfg.env, episodes, replicas)  # a copy: the run's own config keeps its cap
        openenv = dataclasses.replace(self.cfg.env.openenv, max_sessions=share)
        return dataclasses.replace(self.cfg, env=dataclasses.replace(self.cfg.env, openenv=openenv))

    def _routes(self) -> WeightRoutes:
        """Which weight groups carry the weights (rollout.weight_transport, `weaver.apply.weight_transport`): one
        broadcast group hosted by update rank 0, or (ipc) one group per update rank that shares its GPU with rollout
        actors. A plan that mixes colocated and separate engines is one line, before any actor starts."""
        try:
            return weight_transport(self.cfg.rollout.weight_transport, self.reservation.of("update"),
                                    self.reservation.of("rollout"))  # fmt: skip
        except PlanError as e:
            raise UserError(str(e)) from None

    # ------------------------------------------------------------ Stages

    def prefetch(self, request: RolloutRequest) -> None:
        """Submit the request's generate calls (split over the replicas in whole groups); nothing waits. Calls from
        this driver run on an actor in the order they were made, so each generate sees the weights loaded last
        before it, whatever the update is doing meanwhile."""
        if request.step not in self._started:
            self._started[request.step] = self._submit(request)

    def _submit(self, request: RolloutRequest) -> list[tuple[int, ray.ObjectRef]]:
        """The request's generate calls: each replica gets a run of whole prompts (and their data rows, which
        multi-turn episodes reset their environments with), labelled with its first row in the step."""
        actors, params, prompts = self.actors["rollout"], request.params, request.prompts
        sizes = self.balancer.split(len(prompts)) if len(actors) > 1 else [len(prompts)]
        parts, lo = [], 0
        for i, size in enumerate(sizes):
            if size:
                parts.append((i, actors[i].call.remote("generate", prompts[lo : lo + size], _chunk(params, lo),
                                                       request.policy_version, request.rows[lo : lo + size])))  # fmt: skip
            lo += size
        return parts

    def rollout(self, request: RolloutRequest) -> Rollouts:
        """The request's rollouts: the prefetched calls' results, else sampled now. A failed call is forgotten, so a
        retry samples again."""
        parts = self._started.pop(request.step, None) or self._submit(request)
        self.sync.collect(wait=False)  # a sync queued behind this rollout must not hold up the trainer
        got = self._get([ref for _, ref in parts], "rollout")
        for (i, _), ro in zip(parts, got, strict=True):  # the replica's own sampling time
            self.balancer.observe(i, int(ro.completion_mask.sum()), max(ro.seconds, 1e-6))
        rollouts = got[0] if len(got) == 1 else concat_rollouts(got, self.pad_id)
        self._stored = (rollouts, parts[0][1] if len(got) == 1 else ray.put(rollouts))
        return rollouts

    def _ref(self, rollouts: Rollouts) -> ray.ObjectRef:
        """The rollouts in the object store: the replica's own result (or the one upload of the merged parts), so the
        reward actor and the update ranks read them without the driver sending them again."""
        if self._stored is None or self._stored[0] is not rollouts:
            self._stored = (rollouts, ray.put(rollouts))
        return self._stored[1]

    def teacher(self, rollouts: Rollouts) -> TeacherScores:
        """The teacher actor's scores of the rollouts (read by reference from the object store)."""
        return self._get([self.teacher_actor.call.remote("logprobs", self._ref(rollouts))], "teacher")[0]

    def reward(self, rows: list[dict], rollouts: Rollouts, step: int,
               teacher: TeacherScores | None = None) -> ScoredBatch:  # fmt: skip
        """The reward actor's scores (distilling, with the teacher's [N, T] log-probs; its top k is the update's)."""
        logp = None if teacher is None else dataclasses.replace(teacher, topk=None)
        return self._get([self.reward_actor.call.remote("score", rows, self._ref(rollouts), step, logp)], "reward")[0]

    def update(self, rollouts: Rollouts, advantages: torch.Tensor, teacher: TeacherScores | None = None) -> UpdateStats:
        """One step on every rank, then the new weights to the rollout actors (`self.sync`). On-policy the loop waits
        for them to load (`sync_seconds`: the whole publish -> loaded path); asynchronous (`algo.max_staleness` > 0)
        the sync queues behind the generate calls in flight and `sync_seconds` is the last finished one's receive
        time. The teacher's top k (distill.topk), if any, goes by `ray.put` like the advantages."""
        ro_ref, adv_ref = self._ref(rollouts), ray.put(advantages)
        top_ref = None if teacher is None or teacher.topk is None else ray.put(teacher.topk)
        stats = self._get([a.call.remote("step", ro_ref, adv_ref, top_ref) for a in self.actors["update"]], "update")[0]
        if self.cfg.algo.max_staleness > 0:
            self.sync.queue(stats.policy_version)
            return dataclasses.replace(stats, sync_seconds=self.sync.load_seconds)
        return dataclasses.replace(stats, sync_seconds=self.sync.publish(stats.policy_version))

    def evaluate(self, rows: list[dict], step: int, probe: bool = False) -> dict:
        self.sync.collect()
        return self._get(
            [self.actors["rollout"][0].call.remote("evaluate", rows, step, self.sync.version, probe)], "rollout"
        )[0]

    def save(self, root: Path, step: int, payload: dict, eval_score: float | None) -> None:
        """Every rank snapshots its state and writes its own shard (in the background unless async_save is off)."""
        self._get([a.call.remote("save", str(root), step, payload, eval_score) for a in self.actors["update"]],
                  "update")  # fmt: skip

    def wait_saved(self) -> SaveReport | None:
        return self._get([a.call.remote("wait_saved") for a in self.actors["update"]], "update")[0]

    def restore(self, ckpt: Path, reward_state: dict | None) -> None:
        versions = self._get([a.call.remote("restore", str(ckpt)) for a in self.actors["update"]], "update")
        self._get([self.reward_actor.call.remote("load_state_dict", reward_state)], "reward")
        self._started = {}
        self.sync.publish(versions[0])

    def reward_state(self) -> dict | None:
        return self._get([self.reward_actor.call.remote("state_dict")], "reward")[0]

    def where(self) -> dict[str, list[dict]]:
        return {stage: self._get([a.where.remote() for a in actors], stage) for stage, actors in self.actors.items()}

    def close(self) -> None:
        """Let each worker release what it holds, then kill every actor (none outlives the run) and give back the
        run's placement group (its GPUs and CPUs)."""
        actors = [a for group in self.actors.values() for a in group]
        with contextlib.suppress(Exception):
            ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=10)
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = {}
        if self.reservation is not None:
            self.reservation.close()
            self.reservation = None

    # ------------------------------------------------------------ results and failures

    def _get(self, refs: list, stage: str, timeout: float | None = None) -> list:
        """Results of `refs` in order, taken as they finish. A dead actor -> WorkerLost as soon as Ray reports it,
        whichever ref it is (a live member of a collective with the dead one, an engine waiting in the weight
        group's broadcast, would otherwise hold the loss up until that group's timeout); an error raised inside a
        worker is re-raised once every ref has finished (a rank that saw its peer die raises first, the peer's
        death is the cause). `timeout`: seconds for all of them.

        The syncs queued behind the generate calls (asynchronous GRPO) are watched too: a rollout actor killed
        before it begins a queued receive leaves update rank 0 waiting for its word (a day, `ready_timeout`), and
        the next update call behind that send would hold this wait as long, unless the dead receiver's queued call
        reports the death here."""
        results, raised = {}, None
        pending = list(dict.fromkeys(refs))
        in_flight = self.sync.in_flight() if self.sync is not None else {}
        watched = {ref: s for ref, s in in_flight.items() if ref not in pending}  # ref -> its stage
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(pending + list(watched), num_returns=1, timeout=left)
            if not ready:
                raise UserError(f"{stage}: the Ray actors did not answer within {timeout:.0f} s")
            ref = ready[0]
            if ref in watched:  # its result or error is the sync's to collect; only a death counts here
                _result(ref, watched.pop(ref))
                continue
            pending.remove(ref)
            results[ref], error = _result(ref, stage)
            raised = raised or error
        if raised is not None:
            cause = raised.cause if isinstance(getattr(raised, "cause", None), BaseException) else None
            raise (cause or raised) from None
        return [results[ref] for ref in refs]


def _result(ref: ray.ObjectRef, stage: str) -> tuple[object, RayTaskError | None]:
    """A finished ref's (result, None), or (None, the error raised inside its worker); a dead actor or a lost object
    -> WorkerLost naming `stage`."""
    try:
        return ray.get(ref), None
    except RayActorError as e:
        raise WorkerLost(f"{stage}: a Ray actor died ({_first_line(e)})") from None
    except ObjectLostError as e:  # its only copy was on a node that died (e.g. the weights a rank returned)
        raise WorkerLost(f"{stage}: a Ray object was lost with its node ({_first_line(e)})") from None
    except RayTaskError as e:
        return None, e


def actor_env(environ: dict[str, str], planned: dict[str, str], python: str = "") -> dict[str, str]:
    """A stage actor's environment variables: the driver's NCCL/gloo settings and the run's weight-group secret
    (`weaver.apply.driver_env`), then the plan's; an actor on another venv's `python` (vLLM's) gets this checkout
    of forgeweave in front of the driver's PYTHONPATH, which it extends, never replaces
    (tests/flows/test_actor_env.py)."""
    env = {**driver_env(environ), **planned}
    if python:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH", "")) if p)
    return env


def object_sizes() -> dict[str, int]:
    """Size in bytes of every object any Ray worker holds a reference to, by object id: each live raylet's node stats
    with memory info (what `ray memory` and `ray.util.state.list_objects` read; the latter needs the dashboard, which
    this venv's Ray does not have)."""
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    sizes: dict[str, int] = {}
    for node in (n for n in ray.nodes() if n["Alive"]):
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        request = node_manager_pb2.GetNodeStatsRequest(include_memory_info=True)
        reply = node_manager_pb2_grpc.NodeManagerServiceStub(channel).GetNodeStats(request, timeout=30)
        for worker in reply.core_workers_stats:
            sizes.update({r.object_id.hex(): max(r.object_size, 0) for r in worker.object_refs})
    return sizes


def _chunk(params: SamplingParams, first_prompt: int) -> SamplingParams:
    """A replica's share of a step starting at prompt `first_prompt`: row j of it is row first_prompt*n + j of the
    step, and its seed (when the step has one) is shifted by as much, so the split does not change the samples."""
    first = first_prompt * params.n
    seed = params.seed if params.seed is None else params.seed + first
    return params if first == 0 else dataclasses.replace(params, seed=seed, first_row=first)


def _check_pools(plan: Plan, run_dir: Path) -> None:
    """Every pool the stages with actors use (the teacher's too, when the run distills) must be offered by a live
    node, else the actors would wait forever to be placed. A pool whose node this run's workers ran on
    (workers.json) is dead now lost it mid-run: the line names the node and says that the run continues with
    --resume once one is back."""
    offered = ray.cluster_resources()
    for stage in [a.stage for a in plan.assignments if a.stage in ("rollout", "reward", "update", "teacher")]:
        for pool in plan.for_stage(stage).pools:
            resource = pool_resource(pool)
            if offered.get(resource, 0) > 0:
                continue
            start = f"`ray start --address HEAD:PORT --resources '{{\"{resource}\": 1000}}'`"
            if lost := _lost_nodes(run_dir, stage):
                raise UserError(
                    f"pool {pool!r} (stage {stage}) lost its Ray node {', '.join(lost)} and no live node offers it: "
                    f"start one with {start}, then continue with --resume"
                )
            raise UserError(f"no Ray node offers pool {pool!r} (stage {stage}): start its nodes with {start}")


def _lost_nodes(run_dir: Path, stage: str) -> list[str]:
    """The nodes (address and id prefix) this run's `stage` workers last ran on that Ray now lists as dead."""
    try:
        where = json.loads((run_dir / "workers.json").read_text()).get(stage, [])
    except (OSError, ValueError, AttributeError):
        return []
    dead = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if not n.get("Alive")}
    return sorted({f"{dead[w['node_id']]} ({w['node_id'][:8]})" for w in where if w.get("node_id") in dead})


def _has_teacher(cfg: RunConfig, plan: Plan) -> bool:
    """Whether the run distills (`distill.teacher`) and so starts a teacher actor: the plan must then place it."""
    if not cfg.distill.teacher:
        return False
    if not any(a.stage == "teacher" for a in plan.assignments):
        raise UserError(f"distill.teacher '{cfg.distill.teacher}' is set but Weaver's plan has no teacher stage: "
                        "plan the run again (flows.planning.plan_run) with this config")  # fmt: skip
    return True


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
