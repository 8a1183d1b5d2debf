"""The `forgeweave` command line: run, eval, export, presets, config, plan, serve, server, worker, dashboard, mlflow,
sync, up, status, down.

Errors a user can fix (a bad config key, a malformed data file, a missing model path) are printed as one
line on stderr with exit code 2; no traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

from flows.runs import resolve_config, resolve_run
from forge.errors import UserError

EPILOG = """examples:
  forgeweave run --preset tiny                     # tiny random model, learns in ~1 minute on CPU
  forgeweave run --preset smollm2-arith            # SmolLM2-135M-Instruct on 2-digit addition (make demo)
  forgeweave run --preset tiny --set update.lr=5e-4 --set steps=100 --name my-run
  forgeweave run --name my-run --resume            # continue from the last checkpoint
  forgeweave run --name my-run --resume --set steps=400 --set update.lr=5e-4   # ... with changes (config_changes.jsonl)
  forgeweave run --preset smollm2-arith --config mine.yaml   # the preset, overlaid by the keys mine.yaml sets
  forgeweave config show --preset tiny --set steps=50 # the resolved config.yaml such a run would have
  forgeweave config keys update                    # every update.* key: type, default, what it does
  forgeweave run --preset tiny --set update.num_processes=2          # 2 update ranks as Ray actors (local Ray)
  forgeweave run --config run.yaml --set orchestration.ray_address=auto   # on a Ray cluster (docs/ray.md)
  forgeweave eval runs/my-run/checkpoints/step-000100
  forgeweave export my-run my-model                # clean HF directory of the latest checkpoint (LoRA merged)
  forgeweave dashboard                             # Streamlit dashboard of ./runs on http://127.0.0.1:8501
  forgeweave mlflow                                # MLflow UI on http://127.0.0.1:5000 for ./runs
  forgeweave sync my-run                           # send what MLflow missed while it was unreachable
  forgeweave up                                    # the whole local stack: Prefect UI, MLflow, dashboard, Ray head
  forgeweave down                                  # stop what `up` started
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forgeweave",
        description="RL post-training for LLMs (GRPO and variants).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run", help="train a policy with GRPO", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG
    )
    _source_args(r)
    r.add_argument("--name", help="run name (directory under the runs dir); default: <preset>-<timestamp>")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set update.lr=1e-5 (repeatable; applied last: preset < --config < --set)",
    )
    r.add_argument(
        "--resume",
        action="store_true",
        help="continue the named run from its latest checkpoint (its own config.yaml; --set changes it, recorded in "
        "config_changes.jsonl)",
    )
    r.add_argument(
        "--allow-network-code",
        dest="overrides",
        action="append_const",
        const="reward.code_exec.allow_network=true",
        help="code_exec: run code even where no network namespace can be made (it could reach the network)",
    )
    _runs_dir_arg(r)
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument(
        "--no-prefect",
        action="store_true",
        help="run the plain recipe in this process instead of as a Prefect flow (embedded mode)",
    )
    e = sub.add_parser("eval", help="evaluate a checkpoint (or any HF model directory) on an eval split")
    e.add_argument("checkpoint", help="checkpoint directory, e.g. runs/NAME/checkpoints/step-000040")
    e.add_argument("--preset", help="preset giving data/eval settings when the checkpoint is not inside a run")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--out", help="write the JSON report here (default: <checkpoint>/eval.json)")
    x = sub.add_parser("export", help="write a run's checkpoint as a clean HF model directory (LoRA merged)")
    x.add_argument("source", help="run name (under --runs-dir), run directory, or checkpoint directory")
    x.add_argument("out", nargs="?", help="HF model directory to write (new); without it, a full-weights "
                   "checkpoint directory gets its model.safetensors in place")  # fmt: skip
    x.add_argument("--out", dest="out_flag", metavar="OUT", help="same as OUT (older usage)")
    x.add_argument("--step", type=int, help="checkpoint step of the run (default: the latest)")
    x.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload OUT to this hub model repo (online only)")
    _runs_dir_arg(x)
    sub.add_parser("presets", help="list the named presets")
    pl = sub.add_parser("plan", help="print Weaver's stage -> resource-pool plan for a config (runs nothing)")
    _source_args(pl)
    pl.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cf = sub.add_parser("config", help="print the resolved config (show) or every config key with its doc (keys)")
    cfs = cf.add_subparsers(dest="config_command", required=True)
    show = cfs.add_parser("show", help="print the resolved, validated config as YAML (what a run's config.yaml holds)")
    _source_args(show)
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    keys = cfs.add_parser("keys", help="list every config key (dotted) with its type, default and one-line doc")
    keys.add_argument("section", nargs="?", default="", help="only this section (e.g. update, model.lora) or key")
    keys.add_argument("--format", choices=["text", "json", "markdown"], default="text")
    pl.add_argument("--pools", help="YAML file listing pools (name, kind, devices, host, work_pool, ...)")
    sv = sub.add_parser("serve", help="register the Prefect deployments (pipeline, evaluate, prepare) and serve them")
    _runs_dir_arg(sv)
    sv.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    srv = sub.add_parser("server", help="start the runs dir's Prefect server (UI + API) on 127.0.0.1, asking for its "
                         "credentials")  # fmt: skip
    _runs_dir_arg(srv)
    srv.add_argument("--port", type=int, default=4200)
    wk = sub.add_parser(
        "worker",
        help="start a Prefect process worker for a work pool (runs the deployments' flow runs; creates the pool)",
    )
    wk.add_argument("--pool", required=True, help="Prefect work pool name (a pool's `work_pool` in the config)")
    wk.add_argument("--poll", type=float, default=1.0, help="seconds between polls for new stage runs (default 1)")
    d = sub.add_parser(
        "dashboard", help="serve the Streamlit dashboard of the runs dir on 127.0.0.1 (asks for a login)"
    )
    _runs_dir_arg(d)
    d.add_argument("--port", type=int, default=8501)
    ml = sub.add_parser("mlflow", help="start the MLflow UI/server on 127.0.0.1 for the runs dir's MLflow store, asking "
                        "for its credentials")  # fmt: skip
    _runs_dir_arg(ml)
    ml.add_argument("--port", type=int, default=5000)
    sy = sub.add_parser("sync", help="send a run's MLflow records that could not be sent during the run")
    sy.add_argument("run", help="run name (under --runs-dir) or run directory")
    _runs_dir_arg(sy)
    sy.add_argument("--uri", default="", help="tracking URI to send to (default: the store the run was using)")
    from flows.stack import add_commands as add_stack_commands

    add_stack_commands(sub, _runs_dir_arg)  # up, status, down
    return p


def _source_args(p: argparse.ArgumentParser) -> None:
    """--preset and --config: the preset is the base, the YAML file overlays the keys it sets (then --set)."""
    p.add_argument(
        "--preset",
        help="named preset, the base config (see `forgeweave presets`); default: the --config file's `preset:` key, "
        "else tiny (without --config)",
    )
    p.add_argument(
        "--config",
        help="YAML config file overlaid on the preset: only the keys it sets change (a run's config.yaml sets all)",
    )


def _runs_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs-dir",
        default=os.environ.get("FORGEWEAVE_RUNS_DIR", "runs"),
        help="where runs live (default: $FORGEWEAVE_RUNS_DIR or ./runs)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (a `kill PID`) exits through Python's cleanup, so Prefect's embedded server is stopped too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # hub ids load when online (built-ins and local paths never reach the hub); no usage reports are sent
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        commands = {
            "run": cmd_run,
            "eval": cmd_eval,
            "export": cmd_export,
            "presets": cmd_presets,
            "config": cmd_config,
            "plan": cmd_plan,
            "serve": cmd_serve,
            "server": cmd_server,
            "worker": cmd_worker,
            "dashboard": cmd_dashboard,
            "mlflow": cmd_mlflow,
            "sync": cmd_sync,
            **stack_commands(),
        }
        return commands[args.command](args)
    except UserError as e:
        print(f"forgeweave: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        where = f" '{e.filename}'" if e.filename else ""
        print(f"forgeweave: error: cannot write{where}: {e.strerror}; free space or fix permissions (or choose "
              "another --runs-dir), then --resume", file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print("forgeweave: interrupted; continue with `forgeweave run --name NAME --resume`", file=sys.stderr)
        return 130


# a full, read-only or forbidden disk, or the file-size limit: the user's to fix, not a bug (any other OSError keeps
# its traceback)
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def one_line(text: str) -> str:
    """An error message as one line: what a library put on further lines is joined with ' | '."""
    return " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def stack_commands() -> dict:
    from flows.stack import cmd_down, cmd_status, cmd_up

    return {"up": cmd_up, "status": cmd_status, "down": cmd_down}


def cmd_run(args) -> int:
    from flows.execute import train
    from flows.planning import plan_run
    from flows.stack import state_path, use_stack
    from flows.stack_auth import credentials_path

    if taken := use_stack(args.runs_dir):  # a `forgeweave up` stack for this runs dir: its Prefect and MLflow
        creds = credentials_path(state_path(args.runs_dir).parent)
        print("using the stack of this runs dir: " + " ".join(f"{k}={v}" for k, v in taken.items())
              + (f" (credentials: {creds})" if creds.is_file() else ""))  # fmt: skip

    cfg, run_dir = resolve_run(args.preset, args.config, args.overrides, args.name, args.runs_dir, args.resume)
    _, plan = plan_run(cfg)  # an impossible plan stops here, before anything is written
    print(f"run {run_dir.name}: preset={cfg.preset or '-'} model={cfg.model.path} steps={cfg.steps} -> {run_dir}")
    if args.no_prefect:
        from flows.tracking import trackers_for_run

        tracker = trackers_for_run(cfg, run_dir)
        summary = train(cfg, run_dir, plan, resume=args.resume, progress=not args.quiet, tracker=tracker)
    else:
        summary = run_with_prefect(args, run_dir)
    print(format_summary(summary))
    if summary.get("mlflow_run_id"):
        print(f"mlflow run: {summary['mlflow_run_id']} (browse with `forgeweave mlflow --runs-dir {run_dir.parent}`)")
    if summary.get("tensorboard_dir"):
        print(f"tensorboard: {summary['tensorboard_dir']} (browse with `tensorboard --logdir {run_dir.parent}`)")
    if summary.get("wandb_dir"):
        print(f"wandb run: {summary['wandb_dir']} (an offline run uploads with `wandb sync {summary['wandb_dir']}`)")
    return 0


def run_with_prefect(args, run_dir: Path) -> dict:
    """The pipeline as a Prefect flow run (embedded server unless PREFECT_API_URL points at one)."""
    quiet_prefect()
    from flows.pipeline import grpo_pipeline, wait_until_recorded

    hide_user_errors_on_console()

    summary = grpo_pipeline(
        preset=args.preset or "",
        config_path=args.config or "",
        overrides=args.overrides,
        name=run_dir.name,
        runs_dir=str(run_dir.parent),
        resume=args.resume,
        progress=not args.quiet,
    )
    expected = summary["prefect_task_runs"]
    recorded = wait_until_recorded(summary["prefect_flow_run_id"], expected)
    if recorded < expected:
        print(f"warning: Prefect recorded {recorded} of {expected} task runs before the timeout", file=sys.stderr)
    print(f"prefect flow run: {summary['prefect_flow_run_id']}")
    return summary


class HideUserErrors(logging.Filter):
    """Drops Prefect's console records about a stage that raised a `UserError` (the exception with its traceback,
    the failed task and flow states): the CLI prints that error itself, as one line. The Prefect API, and so the
    UI's logs, still receive them; other errors are untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, UserError):
            return False
        names = "|".join(sorted({"UserError", *(c.__name__ for c in _subclasses(UserError))}))
        return re.search(rf"\b({names})\b", record.getMessage()) is None


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def hide_user_errors_on_console() -> None:
    """Put `HideUserErrors` on Prefect's console handlers (configured when prefect is imported); idempotent."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, HideUserErrors) for f in handler.filters
        ):
            handler.addFilter(HideUserErrors())


def quiet_prefect() -> None:
    """Per-task INFO lines would drown the progress bar; warnings and errors still show."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


def format_summary(s: dict) -> str:
    init, final = s["eval"]["initial"], s["eval"]["final"]
    lines = ["", f"{'eval':<14}{'before':>10}{'after':>10}"]
    for key in sorted(k for k in final if k.startswith("pass@")):
        lines.append(f"{key:<14}{init.get(key, float('nan')):>10.3f}{final[key]:>10.3f}")
    if probe := s.get("probe"):  # a run with a probe set (collapse.probe_source): the collapse guard's figures
        lines.append(f"{'probe pass@1':<14}{'best':>10}{probe['best_pass@1']:>10.3f}  (step {probe['best_step']}; "
                     f"guard firings {probe['guard_events']}, rollbacks {probe['rollbacks']})")  # fmt: skip
    if s.get("stopped"):
        lines.append(f"stopped early: {s['stopped']}")
    lines += ["", f"{'stage':<14}{'seconds':>10}{'share':>10}"]
    total = s["seconds"]["total"]
    for stage in ("rollout", "reward", "update", "evaluate"):
        sec = s["seconds"].get(stage, 0.0)
        lines.append(f"{stage:<14}{sec:>10.1f}{sec / max(total, 1e-9):>10.0%}")
    lines.append(f"{'total':<14}{total:>10.1f}")
    lines += ["", f"run directory: {s['run_dir']}"]
    return "\n".join(lines)


def cmd_eval(args) -> int:
    from flows.evaluation import evaluate_checkpoint_dir

    ckpt = Path(args.checkpoint)
    report = evaluate_checkpoint_dir(ckpt, args.preset, args.overrides, out=Path(args.out) if args.out else None)
    brief = {k: round(v, 4) for k, v in report.items() if k.startswith("pass@")}
    print(json.dumps({"checkpoint": str(ckpt), "problems": report["problems"], **brief}))
    print(f"report: {Path(args.out) if args.out else ckpt / 'eval.json'}")
    return 0


def cmd_export(args) -> int:
    from flows.export import export, resolve_checkpoint

    if args.out and args.out_flag and args.out != args.out_flag:
        raise UserError(f"export: OUT '{args.out}' and --out '{args.out_flag}' differ: give one of them")
    ckpt = resolve_checkpoint(args.source, args.step, args.runs_dir)
    out = args.out or args.out_flag
    print(f"wrote {export(ckpt, Path(out) if out else None, push_to_hub=args.push_to_hub)}")
    return 0


def cmd_plan(args) -> int:
    from flows.planning import memory_report, plan_run, resolve_pools

    cfg = resolve_config(args.preset, args.config, args.overrides)
    plan, _ = plan_run(cfg, pools_file=args.pools)
    print(plan.table())
    print()
    print(memory_report(cfg, plan, resolve_pools(cfg, args.pools)))
    return 0


def cmd_serve(args) -> int:
    from flows.deployments import DEPLOYMENTS, serve

    quiet_prefect()
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError(
            "PREFECT_API_URL is not set: start a server (`forgeweave server`) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    from flows.stack import credentials_for

    # the runs dir's own Prefect server (`up`'s or `forgeweave server --runs-dir` alone) asks for its auth string
    for key, value in credentials_for(Path(args.runs_dir), os.environ["PREFECT_API_URL"]).items():
        os.environ.setdefault(key, value)
    print("serving deployments (Ctrl-C to stop):")
    for name, what in DEPLOYMENTS.items():
        print(f"  {name:<46} {what}")
    serve(args.runs_dir, limit=args.limit)
    return 0


def cmd_server(args) -> int:
    """Replace this process with the runs dir's Prefect server on 127.0.0.1, as `up` starts it (its credentials,
    database and home under <runs-dir>/.stack): flows.stack.start_alone."""
    from flows.stack import start_alone

    return start_alone("prefect", args.runs_dir, args.port)


def cmd_worker(args) -> int:
    """Replace this process with `prefect worker start` for one process work pool (so its PID is the worker's)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError("PREFECT_API_URL is not set: export PREFECT_API_URL=http://HOST:4200/api (the Prefect server)")
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": str(args.poll), "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
    prefect = Path(sys.executable).with_name("prefect")
    print(f"worker for work pool {args.pool!r} on {os.uname().nodename} (Ctrl-C to stop)", flush=True)
    # a worker started in the background inherits an ignored SIGINT and then cannot be stopped by SIGTERM either
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execve(prefect, [str(prefect), "worker", "start", "--pool", args.pool, "--type", "process"], env)


DASHBOARD_HOSTS = ("127.0.0.1", "localhost")  # the names the dashboard is served under (any port)


def cmd_dashboard(args) -> int:
    """Replace this process with `streamlit run dashboard/app.py` on 127.0.0.1 (so its PID is the server's).

    The runs dir travels as $FORGEWEAVE_RUNS_DIR (absolute); PYTHONPATH names the checkout holding `dashboard`. The
    app asks each browser session for a login (dashboard/login.py): the runs dir's stack credentials or the token of
    the URL printed here, both in its environment (flows.stack.dashboard_env), which only this user may read."""
    import dashboard
    from flows.stack import credentials_note, dashboard_env
    from flows.stack_auth import DASHBOARD_TOKEN_VAR, credentials_path

    app = Path(dashboard.__file__).with_name("app.py")
    runs = Path(args.runs_dir).resolve()
    root = str(app.parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    runs.mkdir(parents=True, exist_ok=True)
    login = dashboard_env(runs)
    env = {**os.environ, "FORGEWEAVE_RUNS_DIR": str(runs), "PYTHONPATH": path, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env |= login
    settings = {
        "server.address": "127.0.0.1",
        "server.port": str(args.port),
        "server.headless": "true",
        "server.fileWatcherType": "none",
        "browser.gatherUsageStats": "false",
        "client.toolbarMode": "viewer",
    }
    flags = [arg for key, value in settings.items() for arg in (f"--{key}", value)]
    # DNS rebinding: a page of another site, its name re-pointed at 127.0.0.1, must not get the app's data; all of it
    # goes over the WebSocket, which Streamlit then opens only for these names in the Host header (403 otherwise)
    flags += [arg for host in DASHBOARD_HOSTS for arg in ("--server.allowedHosts", host)]
    print(
        f"dashboard on http://127.0.0.1:{args.port}/?token={login[DASHBOARD_TOKEN_VAR]} (runs: {runs}); Ctrl-C to stop"
    )
    print(credentials_note(credentials_path(runs / ".stack")), flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "streamlit", "run", str(app), *flags], env)


def cmd_mlflow(args) -> int:
    """Replace this process with the runs dir's MLflow server on 127.0.0.1 over <runs-dir>/mlflow.db (the embedded
    store), running MLflow's basic-auth app as `up` does: flows.stack.start_alone."""
    from flows.stack import start_alone

    return start_alone("mlflow", args.runs_dir, args.port)


def cmd_sync(args) -> int:
    from flows.tracking.mlflow_tracker import Busy, sync_run
    from flows.tracking.outbox import OUTBOX

    run_dir = Path(args.run) if Path(args.run).is_dir() else Path(args.runs_dir) / args.run
    if not (run_dir / OUTBOX).is_file():
        raise UserError(f"'{run_dir}' has no {OUTBOX}: not a run tracked with MLflow (or no such run)")
    try:
        result = sync_run(run_dir, uri=args.uri)
    except Busy:
        raise UserError(f"run '{run_dir.name}' is being sent by its own process right now; try again later") from None
    except Exception as e:
        why = one_line(str(e))[:200]
        raise UserError(f"could not reach MLflow for '{run_dir.name}' ({why}); nothing is lost, retry") from None
    print(f"sent {result['sent']} records of run {run_dir.name} to {result['uri']} (MLflow run {result['run_id']})")
    if result["skipped"]:
        print(f"{result['skipped']} record(s) were rejected by MLflow: see {run_dir / 'mlflow_state.json'}")
    return 0


def cmd_config(args) -> int:
    from forge.config import describe_keys, dump_yaml, format_keys

    if args.config_command == "show":
        print(dump_yaml(resolve_config(args.preset, args.config, args.overrides)), end="")
    else:
        print(format_keys(describe_keys(args.section), args.format))
    return 0


def cmd_presets(args) -> int:
    from forge.presets import PRESETS

    for name, fn in PRESETS.items():
        cfg = fn()
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        print(f"{name:<16} model={cfg.model.path:<24} steps={cfg.steps:<5} {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
