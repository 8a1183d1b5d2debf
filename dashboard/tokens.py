"""A sample's tokens for the token view: samples.jsonl's `tokens` record (forge.rundir.token_record: parallel lists
`ids`, `text`, `loss`, `logprob` and, with per-token advantages, `advantage`; distilling, `teacher`, the teacher's
log-ratio per sampled token; `gap`, the trainer's log-prob less the sampler's, where the update recorded it) as a
table and as HTML.

In the HTML every token is a span: the tokens the policy sampled (loss mask 1: trained) on blue, those the
environment, tools or agent added (loss mask 0: attended, not trained) on grey in italics, a sampled token the
sampler gave less than `UNLIKELY` probability underlined in red, one whose trainer log-prob differs from the
sampler's by more than `GAP` nats outlined in orange; hovering a token shows its place, id, sampling log-prob,
advantage, teacher log-ratio and trainer gap. Token text is HTML-escaped; a newline shows as ↵ before the line break. Samples written
before the record existed have no `tokens` (`has_tokens` is False).
"""

from __future__ import annotations

import html
import math

import pandas as pd

SAMPLED, ADDED = "sampled", "added"  # the two kinds the loss mask tells apart
UNLIKELY = 0.1  # a sampled token below this sampling probability is marked
GAP = 0.5  # a sampled token whose trainer and sampler log-probs differ by more (nats) is marked: a mismatch to look at
STYLE = """<style>
.fw-tokens {font-family: monospace; font-size: 0.9rem; line-height: 1.9; white-space: pre-wrap; overflow-wrap: anywhere}
.fw-tokens span {border-radius: 3px; padding: 1px 0; margin-right: 1px}
.fw-sampled {background: #cfe3ff; color: #0b2e5e}
.fw-added {background: #e6e6e6; color: #555; font-style: italic}
.fw-unlikely {text-decoration: underline wavy #d62728}
.fw-gap {outline: 2px solid #ff7f0e}
</style>"""
LEGEND = (
    '<span class="fw-sampled">sampled by the policy (loss mask 1, trained)</span> '
    '<span class="fw-added">added by the environment, tools or agent (loss mask 0, not trained)</span> '
    f'<span class="fw-sampled fw-unlikely">sampled with probability &lt; {UNLIKELY:g}</span> '
    f'<span class="fw-sampled fw-gap">trainer and sampler log-probs {GAP:g}+ nats apart</span>'
)


def has_tokens(sample) -> bool:
    """The sample carries a token record (a dict with its ids)."""
    return isinstance(sample, dict) and isinstance(sample.get("ids"), list)


def token_texts(tokens: dict) -> list[str]:
    """Each token's text; a record without text (its tokenizer could not be loaded) shows the ids as `[id]`."""
    text = tokens.get("text")
    return [str(t) for t in text] if isinstance(text, list) else [f"[{i}]" for i in tokens["ids"]]


def token_table(tokens: dict) -> pd.DataFrame:
    """One row per token: place, text, id, kind (sampled / added, by the loss mask), sampling log-prob and probability
    (where the sampler gave one: the sampled tokens, also those of an episode taken out of the loss), the
    advantage where the record has per-token ones, and where recorded the teacher's log-ratio and the trainer gap
    (log pi_old - log mu: the trainer's log-prob of the token before the step's update, less the sampler's).

    >>> token_table({"ids": [5, 6], "text": ["a", "b"], "loss": [1, 0], "logprob": [-0.5, 0.0]}).values.tolist()
    [[0, 'a', 5, 'sampled', -0.5, 0.6065], [1, 'b', 6, 'added', None, None]]
    """
    n = len(tokens["ids"])
    kinds = [SAMPLED if keep else ADDED for keep in (tokens.get("loss") or [1] * n)]
    recorded = tokens.get("logprob") or [None] * n
    logp = [
        lp if lp is not None and (kind == SAMPLED or lp != 0) else None
        for kind, lp in zip(kinds, recorded, strict=True)
    ]
    frame = pd.DataFrame(
        {
            "#": range(n),
            "token": token_texts(tokens),
            "id": tokens["ids"],
            "kind": kinds,
            "log-prob": pd.Series(logp, dtype=object),
            "prob": pd.Series([None if lp is None else round(math.exp(lp), 4) for lp in logp], dtype=object),
        }
    )
    for key, column in (("advantage", "advantage"), ("teacher", "teacher log-ratio"), ("gap", "trainer gap")):
        if isinstance(tokens.get(key), list):
            frame[column] = pd.Series(tokens[key], dtype=object)
    return frame


def token_html(tokens: dict) -> str:
    """The tokens as styled spans (see the module docstring), in one block with its style sheet.

    >>> token_html({"ids": [1, 2], "text": ["<b>", "\\n"], "loss": [1, 0], "logprob": [-3.0, 0.0]}).split("</style>")[1]
    '<div class="fw-tokens"><span class="fw-sampled fw-unlikely" title="#0 · id 1 · log-prob -3 (p 0.0498)">&lt;b&gt;</span><span class="fw-added" title="#1 · id 2 · not trained">↵\\n</span></div>'
    """
    spans = [_span(row) for row in token_table(tokens).to_dict("records")]
    return f'{STYLE}<div class="fw-tokens">{"".join(spans)}</div>'


def _span(row: dict) -> str:
    """One token's span: its class by kind (and a low probability), its figures as the hover text."""
    sampled, lp, p = row["kind"] == SAMPLED, row["log-prob"], row["prob"]
    cls = "fw-sampled" if sampled else "fw-added"
    gap = row.get("trainer gap")
    cls += " fw-unlikely" if sampled and p is not None and p < UNLIKELY else ""
    cls += " fw-gap" if sampled and gap is not None and abs(gap) > GAP else ""
    tip = [f"#{row['#']}", f"id {row['id']}"] + ([f"log-prob {lp:g} (p {p:g})"] if lp is not None else [])
    tip += ([] if sampled else ["not trained"]) + (
        [f"advantage {a:g}"] if (a := row.get("advantage")) is not None else []
    )
    tip += [f"teacher log-ratio {t:g}"] if sampled and (t := row.get("teacher log-ratio")) is not None else []
    tip += [f"trainer gap {gap:g}"] if sampled and gap is not None else []
    text = html.escape(row["token"]).replace("\n", "↵\n") if row["token"] else "∅"  # an empty token stays visible
    return f'<span class="{cls}" title="{html.escape(" · ".join(tip))}">{text}</span>'


def summary(tokens: dict) -> str:
    """`N tokens: S sampled (trained), A added · mean sampling log-prob of the sampled ones X`.

    >>> summary({"ids": [1, 2, 3], "loss": [1, 0, 1], "logprob": [-1.0, 0.0, -2.0]})
    '3 tokens: 2 sampled (trained), 1 added · mean sampling log-prob of the sampled ones -1.5'
    """
    table = token_table(tokens)
    sampled = table[table["kind"] == SAMPLED]
    line = f"{len(table)} tokens: {len(sampled)} sampled (trained), {len(table) - len(sampled)} added"
    logps = [lp for lp in sampled["log-prob"] if lp is not None]
    line += f" · mean sampling log-prob of the sampled ones {sum(logps) / len(logps):.4g}" if logps else ""
    gaps = [abs(g) for g in sampled.get("trainer gap", []) if g is not None]
    return line + (f" · mean |trainer gap| {sum(gaps) / len(gaps):.4g}" if gaps else "")
