"""MLflow as the system of record: one MLflow run per forgeweave run, fed through an outbox in the run directory.

`MlflowTracker` implements `forge.tracking.Tracker`. Each call only appends a record to
`run_dir/mlflow_outbox.jsonl` (see `flows.tracking.outbox`) and wakes a background thread that delivers pending
records in order with `MlflowClient` (metrics, params and tags of consecutive records go in one `log_batch`). Training
therefore never waits on MLflow and never fails because of it: while the store is unreachable the thread backs
off (1 s doubling to 30 s), and the records stay in the outbox until a later attempt succeeds, at the end of the
run (waits at most `tracking.finish_timeout_s`), or `forgeweave sync RUN` sends them. A record the store rejects
for good (e.g. a param changed on resume, a checkpoint deleted by retention before it was sent) is skipped and
listed in mlflow_state.json's "skipped" instead of blocking the queue.

Layout in MLflow (the dashboard relies on it):
- store: `tracking.uri`, else $MLFLOW_TRACKING_URI, else `sqlite:///<runs-dir>/mlflow.db` with the experiment's
  artifacts in `<runs-dir>/mlartifacts` (never ./mlruns); experiment `tracking.experiment` ("forgeweave"). When the
  store is the MLflow server of the runs dir's `forgeweave up` stack, its credentials are used (flows/stack_auth.py)
  unless MLFLOW_TRACKING_USERNAME/PASSWORD are set.
- run name = run directory name; tags `forgeweave.run_dir` (absolute path), `forgeweave.run_name`,
  `forgeweave.preset`, `forgeweave.model`, `forgeweave.dataset_hash`, `forgeweave.git_commit` (and
  `mlflow.source.git.commit`), `forgeweave.prefect_flow_run_id` when run by Prefect.
- params: the resolved config flattened (`update.lr`, ...); metrics: the step's namespaced metrics with its
  step number; MLflow allows only `[/\\w.\\- :]` in names, so `@` becomes `_at_` (`eval/pass@1` -> `eval/pass_at_1`).
- artifacts: config.yaml, plan.json, data/manifest.json, eval/step-NNNNNN.json, samples/step-NNNNNN.json (a
  table: {"columns": [...], "data": [[...], ...]}; a multi-turn run's rows add the transcript as text and JSON and
  the episode's figures, see flows/tracking/tables.py), checkpoints/step-NNNNNN/ (HF files; not trainer_state.* or
  the state/ shards), summary.json.
- registry: each checkpoint is a version of `tracking.registered_model` (default `forgeweave-<preset>`), source
  `runs:/<run_id>/checkpoints/step-NNNNNN`, tags `forgeweave.run_name`, `forgeweave.run_dir`, `forgeweave.run_id`,
  `forgeweave.step`, `forgeweave.dataset_hash`, `forgeweave.eval_pass_at_1` ("" when not evaluated at that step).

A resumed run keeps its MLflow run; steps it redoes that were already recorded (same values: resume is exact)
are not recorded twice. mlflow is imported only inside the sending code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import threading
from pathlib import Path

from flows.tracking.outbox import Outbox, fresh_state, sending_lock
from flows.tracking.tables import table_row
from forge.io import write_json
from forge.tracking import NullTracker

CHECKPOINT_SKIP = {"trainer_state.json", "trainer_state.safetensors", "trainer_state.pt"}  # resume state, not the model
PERMANENT = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"}
BATCH_LIMITS = {"metrics": 1000, "params": 100, "tags": 100}
MAX_PARAM_CHARS = 6000
WINDOW = 500  # records sent (and then marked sent) together


def mlflow_key(name: str) -> str:
    """A metric/param/tag name MLflow accepts: `@` -> `_at_`, any other invalid character -> `_`.

    >>> mlflow_key("eval/pass@1"), mlflow_key("reward/math_answer/mean")
    ('eval/pass_at_1', 'reward/math_answer/mean')
    """
    name = name.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "/_.- :" else "_" for c in name)


def default_uri(runs_dir: Path) -> str:
    return "sqlite:///" + str((Path(runs_dir) / "mlflow.db").resolve())  # 4 slashes: an absolute path


def resolve_uri(configured: str, runs_dir: Path) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else the embedded sqlite store of the runs directory."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI", "") or default_uri(runs_dir)


def registered_model_name(cfg) -> str:
    return cfg.tracking.registered_model or f"forgeweave-{cfg.preset or 'custom'}"


def tracker_for_run(cfg, run_dir: Path, tags: dict[str, str] | None = None) -> MlflowTracker | None:
    """The MLflow tracker `forgeweave run` uses (None when tracking.mlflow is off). Touches nothing until used."""
    t = cfg.tracking
    if not t.mlflow:
        return None
    run_dir = Path(run_dir).resolve()
    _short_timeouts(t.timeout_s)  # the outbox retries; a dead server costs ~0 s
    target = Target(resolve_uri(t.uri, run_dir.parent), t.experiment, run_dir)
    _stack_credentials(run_dir.parent, target.uri)
    return MlflowTracker(target, registered_model_name(cfg), t.log_checkpoints, t.finish_timeout_s, tags or {})


class Target:
    """Where a run's records go: store URI, experiment, and the run (found by its run-dir tag or created)."""

    def __init__(self, uri: str, experiment: str, run_dir: Path):
        self.uri, self.experiment, self.run_dir = uri, experiment, Path(run_dir).resolve()

    def artifact_location(self) -> str | None:
        """The embedded store keeps artifacts beside its database; a server decides for itself."""
        if self.uri.startswith("sqlite:///"):
            return (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        return None


# ---------------------------------------------------------------- the tracker (training side)


class MlflowTracker(NullTracker):
    def __init__(self, target: Target, model_name: str, log_checkpoints: bool, finish_timeout_s: float, tags: dict):
        self.target, self.model_name = target, model_name
        self.log_checkpoints, self.finish_timeout_s = log_checkpoints, finish_timeout_s
        self.tags = {"forgeweave.run_dir": str(target.run_dir), "forgeweave.run_name": target.run_dir.name, **tags}
        self.outbox = Outbox(target.run_dir)
        self.worker: Worker | None = None
        self.recorded_through = -1  # steps a resumed run recorded before: not recorded again
        self.warned = False

    def _start(self) -> None:
        if self.worker is not None:
            return
        self.recorded_through = self.outbox.max_step("metrics")
        self.outbox.append("start")
        self.outbox.append("tags", tags=self.tags)
        self.worker = Worker(Sender(self.outbox, self.target))
        self.worker.start()

    def _put(self, op: str, **fields) -> None:
        """Append a record and wake the sender; never raises (a tracking problem must not stop training)."""
        try:
            self._start()
            self.outbox.append(op, **fields)
            self.worker.wake()
        except Exception as e:  # tracking must never fail training
            self._warn(e)

    def _redone(self, step: int) -> bool:
        """True for a step a resumed run already recorded before it was stopped."""
        try:
            self._start()
        except Exception as e:
            self._warn(e)
        return step <= self.recorded_through

    def _warn(self, e: Exception) -> None:
        if not self.warned:
            print(f"forgeweave: warning: MLflow tracking stopped for this run: {e}", file=sys.stderr)
            self.warned = True

    def log_params(self, params: dict) -> None:
        items = [(mlflow_key(k), _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), BATCH_LIMITS["params"]):  # one record must fit one log_batch
            self._put("params", params=dict(items[i : i + BATCH_LIMITS["params"]]))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update({k: str(v) for k, v in tags.items()})
        self._put("tags", tags={mlflow_key(k): str(v) for k, v in tags.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._redone(step):
            return
        finite = {mlflow_key(k): float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
        self._put("metrics", step=step, metrics=finite)

    def log_artifact(self, path: Path, artifact_path: str = "") -> None:
        self._put("artifact", path=str(Path(path).resolve()), artifact_path=artifact_path)

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        if not rows or self._redone(step):
            return
        rows = [table_row(r) for r in rows]  # flat ({"scores": {"v": 1.0}} -> "scores.v"), a transcript as text
        columns = list(dict.fromkeys(c for r in rows for c in r))
        self._put("table", name=name, step=step, columns=columns, data=[[r.get(c) for c in columns] for r in rows])

    def register_checkpoint(self, path: Path, step: int, eval_score: float | None) -> None:
        if not self.log_checkpoints:
            return
        lineage = {
            "forgeweave.run_name": self.target.run_dir.name,
            "forgeweave.run_dir": str(self.target.run_dir),
            "forgeweave.step": str(step),
            "forgeweave.dataset_hash": self.tags.get("forgeweave.dataset_hash", ""),
            "forgeweave.eval_pass_at_1": "" if eval_score is None else repr(float(eval_score)),
        }
        self._put("checkpoint", path=str(Path(path).resolve()), step=step, model=self.model_name, tags=lineage)

    def info(self) -> dict:
        """{"mlflow_run_id": ...} once the sender reached the store (waits for its first attempt); None if not."""
        if self.worker is None:
            return {}
        self.worker.first_attempt.wait(self.finish_timeout_s)
        return {"mlflow_run_id": self.outbox.load_state(self.target.uri).get("run_id")}

    def finish(self, status: str) -> None:
        if self.worker is None:
            return
        self._put("end", status=status)
        left = self.worker.stop(self.finish_timeout_s)
        if left:
            print(
                f"forgeweave: warning: {left} MLflow records not sent to {self.target.uri} yet "
                f"({self.worker.last_error}); they are kept in {self.outbox.path} — send them with "
                f"`forgeweave sync {self.target.run_dir}`",
                file=sys.stderr,
            )


def _param_value(v) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    return text[:MAX_PARAM_CHARS]


class Worker(threading.Thread):
    """Drains the outbox when woken, at most once per `interval` s (so records of fast steps share one batch);
    after a failure waits 1 s, doubling up to 30 s, before trying again. Stopping skips both waits."""

    def __init__(self, sender: Sender, interval: float = 1.0):
        super().__init__(name="forgeweave-mlflow", daemon=True)
        self.sender, self.interval = sender, interval
        self.woken, self.stopping, self.first_attempt = threading.Event(), threading.Event(), threading.Event()
        self.backoff, self.last_error, self.left = 0.0, "", 0

    def wake(self) -> None:
        if self.backoff == 0:
            self.woken.set()

    def run(self) -> None:
        while True:
            self.woken.wait(self.backoff or None)
            self.woken.clear()
            final = self.stopping.is_set()
            self._attempt()
            if final:
                return
            self.stopping.wait(self.interval)

    def _attempt(self) -> None:
        try:
            self.left = self.sender.drain()
            self.backoff, self.last_error = 0.0, ""
        except Exception as e:  # unreachable store, locked database, ...: retry later
            self.last_error = f"{type(e).__name__}: {str(e)[:300]}"
            self.backoff = min(max(self.backoff * 2, 1.0), 30.0)
            self.left = -1
        finally:
            self.first_attempt.set()

    def stop(self, timeout: float) -> int:
        """Make a last attempt now, wait up to `timeout` s; return how many records are still unsent."""
        self.stopping.set()
        self.woken.set()
        self.join(timeout)
        if self.is_alive() or self.left != 0:
            state = self.sender.outbox.load_state(self.sender.target.uri)
            return len(self.sender.outbox.pending(state))
        return 0


# ---------------------------------------------------------------- the sender (shared with `forgeweave sync`)


class Busy(RuntimeError):
    """Another process is sending this run's outbox right now."""


class Sender:
    """Delivers a run's outbox records to its MLflow run, in order, each exactly once in effect."""

    def __init__(self, outbox: Outbox, target: Target):
        self.outbox, self.target = outbox, target
        self.client = None
        self.verified_run: str | None = None

    def drain(self) -> int:
        """Send every pending record; return how many remain (0). Raises on a failure worth retrying."""
        with sending_lock(self.target.run_dir) as mine:
            if not mine:
                raise Busy(f"another process is sending {self.outbox.path}")
            state = self.outbox.load_state(self.target.uri)
            pending = self.outbox.pending(state)
            if not pending:
                return 0
            run_id = self._connect(state, pending[0][1]["ts"])
            pending = self.outbox.pending(state)  # _connect may have reset the state (run gone from the store)
            for start in range(0, len(pending), WINDOW):
                window = pending[start : start + WINDOW]
                self._send_window(run_id, [r for _, r in window], state)
                state["sent"], state["offset"] = window[-1][1]["seq"], window[-1][0]
                self.outbox.save_state(state)
            return 0

    def _send_window(self, run_id: str, records: list[dict], state: dict) -> None:
        """Send a run of records grouped by kind: their order matters only for the run status (sent last).

        All metrics/params/tags go in as few log_batch calls as the limits allow, each step's table in one
        artifact upload per table name. If any call fails the whole window is sent again later (idempotent)."""
        batch = [r for r in records if r["op"] in BATCH_LIMITS]
        for chunk in _chunks(batch):
            self._send_safely(Sender._send_batch, run_id, chunk, state)
        tables = [r for r in records if r["op"] == "table"]
        for name in dict.fromkeys(r["name"] for r in tables):
            self._send_safely(Sender._send_tables, run_id, [r for r in tables if r["name"] == name], state)
        rest = [r for r in records if r["op"] not in BATCH_LIMITS and r["op"] != "table"]
        for r in sorted(rest, key=lambda r: (r["op"] in ("start", "end"), r["seq"])):
            self._send_safely(SEND[r["op"]], run_id, [r], state)

    def _connect(self, state: dict, start_ts: int) -> str:
        if self.client is None:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            from mlflow import MlflowClient

            for name in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..." would break the bar
                logging.getLogger(name).setLevel(logging.WARNING)

            self.client = MlflowClient(tracking_uri=self.target.uri, registry_uri=self.target.uri)
        run_id = state.get("run_id")
        if run_id and run_id != self.verified_run and not self._run_alive(run_id):
            state.clear()
            state.update(fresh_state(self.target.uri))  # the run is gone from the store: resend everything
            run_id = None
        if not run_id:
            exp_id = self._experiment_id()
            run_id = self._find_run(exp_id) or self._create_run(exp_id, start_ts)
            state.update(experiment_id=exp_id, run_id=run_id)
            self.outbox.save_state(state)
        self.verified_run = run_id
        return run_id

    def _run_alive(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.target.experiment)
        if exp is None:
            try:
                return self.client.create_experiment(
                    self.target.experiment, artifact_location=self.target.artifact_location()
                )
            except MlflowException as e:  # created by another process meanwhile
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(self.target.experiment)
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def _find_run(self, exp_id: str) -> str | None:
        path = str(self.target.run_dir)
        if '"' in path:
            return None
        found = self.client.search_runs([exp_id], filter_string=f'tags."forgeweave.run_dir" = "{path}"')
        return found[0].info.run_id if found else None

    def _create_run(self, exp_id: str, start_ts: int) -> str:
        from mlflow.exceptions import MlflowException

        tags = {"forgeweave.run_dir": str(self.target.run_dir), "forgeweave.run_name": self.target.run_dir.name}
        try:
            run = self.client.create_run(exp_id, start_time=start_ts, tags=tags, run_name=self.target.run_dir.name)
        except MlflowException as e:  # a stack's runs log as a user that may write only where it made the experiment
            if e.error_code != "PERMISSION_DENIED":
                raise
            user = os.environ.get("MLFLOW_TRACKING_USERNAME", "this user")
            raise MlflowException(
                f"MLflow user {user} may not write to experiment '{self.target.experiment}' (another user made it): "
                f"give {user} EDIT on it (its permissions in MLflow's UI) or set tracking.experiment to a new name",
                error_code="PERMISSION_DENIED",
            ) from None
        return run.info.run_id

    def _send_safely(self, send, run_id: str, chunk: list[dict], state: dict) -> None:
        """send(self, run_id, chunk); a rejection for good retries the records one by one and skips only those
        that fail alone (listed in state["skipped"]); any other error propagates (retry later)."""
        from mlflow.exceptions import MlflowException

        try:
            send(self, run_id, chunk)
        except (MlflowException, FileNotFoundError) as e:
            if isinstance(e, MlflowException) and e.error_code not in PERMANENT:
                raise
            if len(chunk) > 1:
                for r in chunk:
                    self._send_safely(send, run_id, [r], state)
                return
            skipped = {"seq": chunk[0]["seq"], "op": chunk[0]["op"], "error": str(e)[:500]}
            state.setdefault("skipped", []).append(skipped)
            print(f"forgeweave: warning: MLflow rejected a {chunk[0]['op']} record: {str(e)[:300]}", file=sys.stderr)

    # one method per record kind ------------------------------------------------

    def _send_batch(self, run_id: str, chunk: list[dict]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics, params, tags = {}, {}, {}
        for r in chunk:
            if r["op"] == "metrics":
                metrics.update({(k, r["step"]): Metric(k, v, r["ts"], r["step"]) for k, v in r["metrics"].items()})
            elif r["op"] == "params":
                params.update(r["params"])
            else:
                tags.update(r["tags"])
        self.client.log_batch(
            run_id,
            metrics=list(metrics.values()),
            params=[Param(k, v) for k, v in params.items()],
            tags=[RunTag(k, v) for k, v in tags.items()],
        )

    def _send_start(self, run_id: str, chunk: list[dict]) -> None:
        self.client.update_run(run_id, status="RUNNING")

    def _send_end(self, run_id: str, chunk: list[dict]) -> None:
        self.client.set_terminated(run_id, status=chunk[-1]["status"], end_time=chunk[-1]["ts"])

    def _send_artifact(self, run_id: str, chunk: list[dict]) -> None:
        r = chunk[0]
        path = Path(r["path"])
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), r["artifact_path"] or None)
        elif path.is_file():
            self.client.log_artifact(run_id, str(path), r["artifact_path"] or None)
        else:
            raise FileNotFoundError(f"{path} no longer exists")

    def _send_tables(self, run_id: str, chunk: list[dict]) -> None:
        """Tables of one name: `<name>/step-NNNNNN.json` each, uploaded together."""
        with tempfile.TemporaryDirectory(prefix="forgeweave-table-") as tmp:
            for r in chunk:
                table = {"columns": r["columns"], "data": r["data"]}
                (Path(tmp) / f"step-{r['step']:06d}.json").write_text(json.dumps(table, ensure_ascii=False))
            self.client.log_artifacts(run_id, tmp, chunk[0]["name"])

    def _send_checkpoint(self, run_id: str, chunk: list[dict]) -> None:
        r = chunk[0]
        ckpt = Path(r["path"])
        if not ckpt.is_dir():
            raise FileNotFoundError(f"checkpoint {ckpt} no longer exists (removed by retention before it was sent)")
        artifact_path = f"checkpoints/{ckpt.name}"
        for f in sorted(ckpt.iterdir()):
            if f.is_file() and f.name not in CHECKPOINT_SKIP:
                self.client.log_artifact(run_id, str(f), artifact_path)
        self._register(r["model"], run_id, artifact_path, {**r["tags"], "forgeweave.run_id": run_id})

    def _register(self, name: str, run_id: str, artifact_path: str, tags: dict) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name, description="forgeweave checkpoints (HF model directories)")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"runs:/{run_id}/{artifact_path}"
        for mv in self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if mv.source == source:
                return  # registered before a crash or a lost reply: do not add a second version
        self.client.create_model_version(name, source=source, run_id=run_id, tags=tags)


SEND = {
    "metrics": Sender._send_batch,
    "params": Sender._send_batch,
    "tags": Sender._send_batch,
    "start": Sender._send_start,
    "end": Sender._send_end,
    "artifact": Sender._send_artifact,
    "table": Sender._send_tables,
    "checkpoint": Sender._send_checkpoint,
}


def _chunks(records: list[dict]) -> list[list[dict]]:
    """metrics/params/tags records in log_batch-sized chunks (MLflow's per-request limits), in order."""
    chunks: list[list[dict]] = [[]]
    counts = dict.fromkeys(BATCH_LIMITS, 0)
    for r in records:
        op, size = r["op"], len(r[r["op"]])
        if counts[op] + size > BATCH_LIMITS[op] or sum(counts.values()) + size > 1000:
            chunks.append([])
            counts = dict.fromkeys(BATCH_LIMITS, 0)
        chunks[-1].append(r)
        counts[op] += size
    return [c for c in chunks if c]


# ---------------------------------------------------------------- `forgeweave sync`


def sync_run(run_dir: Path, uri: str = "") -> dict:
    """Send what a run's outbox still holds. uri: where to (default: the store the run was tracking to).

    Returns {"uri", "run_id", "sent", "skipped"}; raises Busy if another process is sending, or the store's
    error if it is unreachable (nothing is lost: try again later)."""
    run_dir = Path(run_dir).resolve()
    _short_timeouts(_run_config(run_dir).get("tracking", {}).get("timeout_s", 10))
    outbox = Outbox(run_dir)
    if not uri:
        try:
            uri = json.loads(outbox.state_path.read_text())["uri"]
        except (OSError, ValueError, KeyError):
            uri = resolve_uri("", run_dir.parent)
    experiment = _run_experiment(run_dir)
    _stack_credentials(run_dir.parent, uri)
    sender = Sender(outbox, Target(uri, experiment, run_dir))
    before = len(outbox.pending(outbox.load_state(uri)))
    sender.drain()
    state = outbox.load_state(uri)
    _fill_summary(run_dir, state.get("run_id"))
    return {"uri": uri, "run_id": state.get("run_id"), "sent": before, "skipped": len(state.get("skipped", []))}


def _run_config(run_dir: Path) -> dict:
    """The run's config.yaml as a plain dict ({} when unreadable)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        return cfg if isinstance(cfg, dict) and isinstance(cfg.get("tracking", {}), dict) else {}
    except (OSError, ValueError):
        return {}


def _short_timeouts(timeout_s) -> None:
    """A dead or black-holed server costs `timeout_s` per request, not MLflow's defaults (120 s, 7 retries with
    backoff: minutes); the outbox keeps what was not sent. Variables set by the user win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout_s) if str(timeout_s).isdigit() else 10))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def _stack_credentials(runs_dir: Path, uri: str) -> None:
    """A `forgeweave up` stack's MLflow server asks for a user: when `uri` is the server of the runs dir's stack,
    its credentials (MLFLOW_TRACKING_USERNAME/PASSWORD, which MlflowClient reads) are set, unless the user set them.
    Never raises: without them the outbox keeps the records (`forgeweave sync` later)."""
    try:
        from flows.stack import credentials_for

        for key, value in credentials_for(runs_dir, uri).items():
            os.environ.setdefault(key, value)
    except Exception as e:  # noqa: BLE001 - an unreadable stack state must not stop training
        logging.getLogger(__name__).warning("stack credentials not read: %s", e)


def _run_experiment(run_dir: Path) -> str:
    """The experiment named in the run's config.yaml (tracking.experiment), else the default."""
    return _run_config(run_dir).get("tracking", {}).get("experiment") or "forgeweave"


def _fill_summary(run_dir: Path, run_id: str | None) -> None:
    """A run that finished while the store was down has summary.json without mlflow_run_id: add it."""
    path = run_dir / "summary.json"
    if run_id and path.exists():
        summary = json.loads(path.read_text())
        if summary.get("mlflow_run_id") != run_id:
            write_json(path, {**summary, "mlflow_run_id": run_id})
