"""Run detail page: key numbers, training curves, stage times, samples, the Weaver plan and the config of one run;
with a probe set, probe pass@1 beside eval pass@1 and the reward, and the collapse guard's firings. A multi-turn run
adds its episode curves (env/*) and shows a picked sample as a chat transcript: the prompt, the policy's turns with
their tool calls set apart, each tool's answer as its own message (errors in red), the environment's first
observation (reset) where it gave one, and the episode's figures. Where samples.jsonl records a sample's tokens,
the picked episode (or, single-turn, a picked sample) is also shown as its tokens: sampled ones apart from those the
environment, tools or agent added (the loss mask), each with its sampling log-prob and advantage on hover and in a
table; the samples table says per sample whether its group had zero reward std and its staleness. A run
with a teacher (on-policy distillation) adds the reverse KL to it, by step and by position in the completion."""

import time

import pandas as pd
import streamlit as st

from dashboard import charts, data, loaders, tokens, transcripts
from dashboard.widgets import empty_state, fmt, live, pick_run

PROBE_TITLE = "probe pass@1 (labelled probe) vs eval pass@1 and reward/mean"
STALE_S = 15 * 60  # a running run whose status.json is older than this may have been killed
# (title, metric columns, mark each point) of the curves after the reward chart; eval columns are added per run
CURVES = [
    ("KL to the reference", ["train/kl_ref"], False),
    ("KL to the policy before the update", ["train/kl_old"], False),
    ("entropy", ["train/entropy"], False),
    ("learning rate", ["train/lr"], False),
    ("grad norm", ["train/grad_norm"], False),
    ("clip fraction", ["train/clip_frac_low", "train/clip_frac_high"], False),
    ("completion length (tokens)", ["completion/len_mean", "completion/len_max"], False),
    ("tokens / s", ["perf/rollout_tokens_per_s", "perf/update_tokens_per_s"], False),
    # asynchronous GRPO: how far the sampler lags the trainer, how much their log-probs differ, who waits
    ("policy staleness (versions)", ["rollout/staleness_mean", "rollout/staleness_max"], False),
    ("trainer vs sampler log-prob gap", ["train/logprob_diff"], False),
    ("idle share of the step", ["perf/rollout_idle_frac", "perf/trainer_idle_frac"], False),
]
# a multi-turn run's episode figures, means per episode of each step's rollouts (forge.metrics.episode_metrics)
ENV_CURVES = [
    ("turns, tool calls and tool errors per episode", ["env/turns", "env/tool_calls", "env/tool_errors"], False),
    ("share of episodes truncated; share of episode tokens trained", ["env/truncated", "env/sampled_frac"], False),
    ("seconds in the environment and tools per episode", ["env/seconds"], False),
    ("share of policy turns cut by rollout.max_new_tokens", ["env/cut_frac"], False),
]
TOOL_AVATAR = ":material/build:"
ENV_AVATAR = ":material/public:"  # the environment's first observation (reset), part of the prompt


def header(name: str) -> None:
    o = loaders.overview(name)
    frame = loaders.metrics(name)
    cols = st.columns(6)
    cols[0].metric("status", o.state)
    cols[1].metric("steps", f"{o.step}/{o.total_steps}" if o.total_steps else str(o.step))
    cols[2].metric("best eval pass@1", fmt(o.best_pass1), help=f"at step {o.best_step}")
    reward = frame["reward/mean"].dropna() if "reward/mean" in frame else None
    cols[3].metric("last reward/mean", fmt(float(reward.iloc[-1])) if reward is not None and len(reward) else "-")
    cols[4].metric("duration", data.fmt_seconds(o.duration_s))
    index = loaders.mlflow_index()
    run_id = index.run_id(o.name, o.path) or o.mlflow_run_id
    cols[5].metric("MLflow run", run_id[:8] if run_id else "-", help=run_id or "no MLflow run found")
    st.caption(
        f"preset `{o.preset or '-'}` · model `{o.model}` · `{o.path}`" + (f" · MLflow run `{run_id}`" if run_id else "")
    )
    if index.run_url(run_id):
        st.link_button("Open in MLflow", index.run_url(run_id))
    if o.state == "failed":
        st.error(f"failed at step {o.step}: {o.error}")
    elif o.state == "running" and o.updated and time.time() - o.updated > STALE_S:
        st.warning(
            f"status.json says running but has not changed for {data.fmt_age(time.time() - o.updated)[:-4]}: "
            f"if its process has stopped, continue it with `forgeweave run --name {o.name} --resume`"
        )
    elif o.state == "running":
        st.info("in progress: curves grow as steps finish; summary.json appears when the run ends")


def curves(name: str) -> None:
    frame = loaders.metrics(name)
    if frame.empty:
        st.info("no metrics yet: metrics.jsonl gets a row after the initial evaluation and after every step")
        return
    evals = [c for c in frame.columns if c.startswith("eval/pass@")]
    specs = [
        ("reward", charts.reward_chart(frame, data.verifier_names(frame))),
        ("eval", charts.lines(frame, evals, "eval pass@k (held-out)", points=True)),
        *((title, charts.lines(frame, cols, title, points)) for title, cols, points in CURVES),
    ]
    if "probe/pass@1" in frame.columns:  # the collapse guard's view: labelled probe vs held-out eval vs the reward
        probe = charts.lines(frame, ["probe/pass@1", "eval/pass@1", "reward/mean"], PROBE_TITLE, points=True)
        specs.insert(2, ("probe", probe))
    _grid(specs)
    bars = charts.stage_bars(data.stage_times(frame))
    if bars is not None:
        st.altair_chart(bars, width="stretch")
    if any(c.startswith("env/") for c in frame.columns):
        st.subheader("Episodes (multi-turn)")
        _grid([(title, charts.lines(frame, cols, title, points)) for title, cols, points in ENV_CURVES])
    if "distill/reverse_kl" in frame.columns:  # distill.teacher: on-policy distillation
        st.subheader("Distillation (teacher)")
        title, kl = "reverse KL to the teacher (mean over sampled tokens)", ["distill/reverse_kl"]
        if "distill/topk_kl" in frame.columns:  # distill.topk: the divergence the loss minimises, beside it
            title, kl = f"{title} and the weighted top-k one the loss minimises", [*kl, "distill/topk_kl"]
        _grid([("reverse KL to the teacher", charts.lines(frame, kl, title)),
               ("by position", charts.position_profile(frame)),
               ("teacher seconds", charts.lines(frame, ["time/teacher_s"], "teacher seconds per step"))])  # fmt: skip


def _grid(specs: list[tuple]) -> None:
    """(title, chart or None) pairs, two per row; a missing chart says "no data yet"."""
    for i, (title, chart) in enumerate(specs):
        if i % 2 == 0:
            row = st.columns(2)  # one row per pair keeps the charts of a row aligned
        with row[i % 2]:
            if chart is None:
                st.caption(f"{title}: no data yet")
            else:
                st.altair_chart(chart, width="stretch")


def guard(name: str) -> None:
    events = loaders.guard_events(name)
    if not events.empty:
        st.subheader("Collapse guard")
        st.warning(data.guard_summary(events))
        st.dataframe(events, hide_index=True)


def any_metric(name: str) -> None:
    frame = loaders.metrics(name)
    names = data.metric_names(frame)
    if names:
        metric = st.selectbox("Any metric", names, index=names.index("reward/mean") if "reward/mean" in names else 0)
        st.altair_chart(charts.lines(frame, [metric], metric, points=True), width="stretch")


def ensemble(name: str) -> None:
    found = loaders.ensemble_report(name)
    if found is not None:
        step, table = found
        st.subheader(f"Label-free verifier ensemble (report of step {step})")
        st.dataframe(table, hide_index=True)


def samples(name: str) -> None:
    frame = loaders.samples(name)
    if frame.empty:
        st.info("no samples yet: samples.jsonl gets a few completions per step")
        return
    steps = _range_slider("steps", frame["step"].dropna(), int)
    rewards = _range_slider("reward", frame["reward"].dropna(), float)
    text = st.text_input("prompt or completion contains")
    shown = data.filter_samples(frame, steps, rewards, text)
    st.caption(f"{len(shown)} of {len(frame)} samples")
    table = shown.drop(columns=["transcript", data.TOKENS], errors="ignore")  # shown as a chat and as tokens below
    st.dataframe(table, hide_index=True, column_config={"completion": st.column_config.TextColumn(width="large")})
    if "transcript" in shown.columns:
        episode(name, shown[shown["transcript"].notna()])
    elif data.TOKENS in shown.columns:  # single-turn: pick a sample for its tokens
        picked_tokens(name, shown[shown[data.TOKENS]])


def picked_tokens(name: str, shown: pd.DataFrame) -> None:
    """The token view of one of the shown samples, picked by a selectbox."""
    if shown.empty:
        return
    st.subheader("Tokens")
    pick = st.selectbox("sample", shown.index.tolist(), format_func=lambda i: _sample_label(i, shown.loc[i]))
    token_view(loaders.sample_tokens(name, pick))


def _sample_label(i: int, row: pd.Series) -> str:
    reward = "-" if pd.isna(row["reward"]) else f"{row['reward']:.3f}"
    return f"#{i} · step {row['step']} · reward {reward}"


def token_view(record) -> None:
    """A sample's tokens (dashboard.tokens): a summary line, the legend, the tokens as coloured spans (hover: place,
    id, log-prob, advantage) and, folded, the per-token table; then each further training sequence of an episode
    whose agent rewrote its history (the record's `more`), as spans under a line that says so."""
    if not tokens.has_tokens(record):
        st.caption("tokens: not recorded (this sample was written before samples.jsonl kept them)")
        return
    st.caption(tokens.summary(record))
    if not any(record.get("loss") or [1]):
        st.caption("this episode is out of the loss (truncated with env.mask_truncated, or its environment failed): "
                   "none of its tokens is trained; the log-probs show which the policy sampled")  # fmt: skip
    st.html(f"{tokens.STYLE}<div>{tokens.LEGEND}</div>")
    st.html(tokens.token_html(record))
    with st.expander("per-token table"):
        st.dataframe(tokens.token_table(record), hide_index=True)
    more = [seq for seq in record.get("more") or [] if tokens.has_tokens(seq)]
    for k, seq in enumerate(more, start=2):  # the agent rewrote its history: sequences trained apart
        st.caption(f"training sequence {k} of {len(more) + 1}: the agent rewrote its history, so what follows its new "
                   f"prompt ({seq.get('prompt_tokens', '?')} tokens, not shown) trains as a sequence of its own, with "
                   f"the episode's reward · {tokens.summary(seq)}")  # fmt: skip
        st.html(tokens.token_html(seq))


def episode(name: str, shown: pd.DataFrame) -> None:
    """One of the shown multi-turn samples, picked by a selectbox: its figures, its chat transcript, its tokens."""
    if shown.empty:
        return
    st.subheader("Episode")
    pick = st.selectbox("episode", shown.index.tolist(), format_func=lambda i: _episode_label(i, shown.loc[i]))
    row = shown.loc[pick]
    for col, label in zip(st.columns(len(data.EPISODE_COLUMNS)), data.EPISODE_COLUMNS, strict=True):
        col.metric(label, _figure(row[label]))
    for message in transcripts.messages(row["prompt"], row["transcript"]):
        chat_message(message)
    if data.TOKENS in shown.columns:
        st.subheader("Tokens")
        token_view(loaders.sample_tokens(name, pick) if row[data.TOKENS] else None)


def _episode_label(i: int, row: pd.Series) -> str:
    """`#i` (the sample's place in samples.jsonl: labels must differ, the selectbox tells options apart by them),
    step, reward and figures."""
    reward = "-" if pd.isna(row["reward"]) else f"{row['reward']:.3f}"
    figures = f"{_figure(row['turns'])} turns · {_figure(row['tool calls'])} tool calls"
    return f"#{i} · step {row['step']} · reward {reward} · {figures}"


def _figure(value) -> str:
    """A figure as the metric shows it: "-" when not recorded, yes/no for a flag, else the count."""
    if pd.isna(value):
        return "-"
    return ("yes" if value else "no") if pd.api.types.is_bool(value) else str(int(value))


def chat_message(m: transcripts.Message) -> None:
    """A message as a chat bubble: a policy turn's prose and tool calls (as JSON) apart, a tool's answer under its
    name, an error answer in red."""
    avatar = {"tool": TOOL_AVATAR, "environment": ENV_AVATAR}.get(m.role)
    with st.chat_message(m.role, avatar=avatar):
        if m.role == "environment":
            st.caption("environment · first observation (reset), in the prompt, not trained")
        if m.role == "assistant":
            st.caption("policy" + ("" if m.policy_version is None else f" v{m.policy_version}"))
        if m.role == "tool":
            st.caption(f"tool `{m.name or '(unreadable call)'}`" + (" · error" if m.error else ""))
        for part in m.parts:
            if part.kind == "call":
                st.caption(f"tool call `{part.name or '(unreadable call)'}`")
                st.code(part.text, language="json")
            elif m.error:
                st.error(part.text)
            else:
                st.text(part.text)


def _range_slider(label: str, values, kind) -> tuple:
    lo, hi = (kind(values.min()), kind(values.max())) if len(values) else (kind(0), kind(0))
    if lo >= hi:  # a slider needs two distinct ends
        st.caption(f"{label}: {lo}")
        return lo, hi
    return st.slider(label, lo, hi, (lo, hi))


def plan(name: str) -> None:
    pools, assignments = loaders.plan(name)
    if assignments.empty:
        st.info("no plan.json in this run")
        return
    st.dataframe(assignments, hide_index=True)
    st.caption("resource pools")
    st.dataframe(pools, hide_index=True)
    workers = loaders.workers(name)
    if not workers.empty:
        st.caption("where each stage ran (one row per worker process; a Ray node id in Ray execution)")
        st.dataframe(workers, hide_index=True)


def config(name: str) -> None:
    cfg = loaders.config(name)
    if not cfg:
        st.info("no config.yaml yet")
        return
    manifest = data.read_json(loaders.run_path(name) / "data" / "manifest.json")
    if manifest:
        keys = ("source", "train_rows", "eval_rows", "rejected_count", "content_hash")
        st.dataframe([{k: manifest.get(k) for k in keys}], hide_index=True)
    flat = data.flatten(cfg)
    st.dataframe([{"key": k, "value": data.show_value(v)} for k, v in flat.items()], hide_index=True, height=420)


def render() -> None:
    st.title("Run detail")
    names = loaders.run_names()
    if not names:
        empty_state()
        return
    name = pick_run(names)
    running = loaders.overview(name).state == "running"
    tab_curves, tab_samples, tab_plan, tab_config = st.tabs(["Curves", "Samples", "Weaver plan", "Config"])

    def live_part() -> None:
        header(name)
        curves(name)

    with tab_curves:
        live(live_part, default=running, key="live_detail")
        guard(name)
        any_metric(name)
        ensemble(name)
    with tab_samples:
        samples(name)
    with tab_plan:
        plan(name)
    with tab_config:
        config(name)


render()
