"""The hf rollout samples exactly softmax(logits / T), in every configuration: its token frequencies against the exact
probabilities by a chi-square test, at the first completion token and at the two after it.

The tiny random Llama (char tokenizer, 98 tokens), its logits spread out (final norm weight 3: the largest first-token
probability ~0.2, a quarter of the mass outside the top 50, so temperature and top-k matter) and eos likely at the
first token (p ~0.2: rows end and leave the batch under compaction). Two prompts of different lengths share every
chunk, so one is left-padded: positions and padding are in the test. Each configuration draws N = 4,000
completions of 3 tokens per prompt, seeded.

Position 0: every row has the same context, so the token counts are multinomial(N, p) and Pearson's statistic is
chi-square with (cells - 1) dof (cells expected below 5 merged into one). Positions 1 and 2: each live row has its own
exact distribution, given its own sampled prefix (one fp32 forward over the distinct prefixes), so the rows are
checked by their probability integral transform: with each row's tokens in order of decreasing probability, u = the
mass before the drawn token + v x its own (v uniform, seeded) is exactly uniform on [0, 1) for a correct sampler,
and the counts of u in 20 equal bins are multinomial(rows, 1/20) (chi-square, 19 dof). A sharper sampler puts u
near 0, a truncated one (top-k) never near 1.

False failures: each check rejects at 1e-6 under the null, 36 checks (6 configurations x 2 prompts x 3 positions):
< 1e-4 for the whole file (Bonferroni); the seeds are fixed, so a run is deterministic anyway. Power: the same
counts are checked to be rejected against a temperature applied twice (T^2), no temperature (T = 1) and generate's
default top_k = 50.
"""

from __future__ import annotations

import math

import pytest
import torch

from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import HFBackend, SamplingParams

torch.set_num_threads(1)

T = 0.7
N = 4_000  # draws per prompt and configuration
STEPS = 3  # completion positions checked
PROMPTS = ["12+34=", "7="]  # "7=" is left-padded beside "12+34="
Z_1E6 = 4.753424  # upper 1e-6 quantile of the standard normal
# configuration -> HFBackend settings (bf16: autocast forced on, as if the CPU had bf16 units)
CONFIGS = {
    "default": {},
    "plain": {"shared_prefill": False, "compact_every": 0},
    "shared-prefill-only": {"compact_every": 0},
    "compact-every-token": {"compact_every": 1},
    "bf16": {"autocast_bf16": True},
    "multi-turn": {},  # generate_ids with a generator per row (`seeded_tokens`)
}


def chi2_critical(dof: int, z: float = Z_1E6) -> float:
    """Upper quantile of chi-square(dof) by Wilson-Hilferty: at 1e-6 and dof >= 10, 0.2% to 2.4% above scipy's exact
    value (test_critical_value_matches_scipy), so the false-failure rate is a little below 1e-6."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def pearson(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(Pearson's statistic, dof) with the cells expected below 5 merged into one; float64 [V] -> (X^2, cells - 1)."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    if (obs[~keep] > 0).any():  # a drawn token of zero probability
        return math.inf, int(keep.sum()) - 1
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def pit_pearson(probs: torch.Tensor, tokens: torch.Tensor, bins: int = 20) -> tuple[float, int]:
    """(Pearson's statistic, dof) of the rows' randomised probability integral transforms in `bins` equal bins:
    [n, V] each row's distribution, [n] its drawn token; inf when a token of zero probability was drawn."""
    order = probs.argsort(dim=-1, descending=True, stable=True)  # [n, V]
    ranked = probs.gather(-1, order)
    rank = (order == tokens[:, None]).long().argmax(-1, keepdim=True)  # [n, 1] the drawn token's place
    mine = ranked.gather(-1, rank).squeeze(-1)
    if (mine == 0).any():
        return math.inf, bins - 1
    before = ranked.cumsum(-1).gather(-1, rank).squeeze(-1) - mine
    v = torch.rand(len(tokens), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    u = (before + v * mine).clamp(0.0, 1.0 - 1e-12)
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    expected = torch.full((bins,), len(tokens) / bins, dtype=torch.float64)
    return float(((counts - expected) ** 2 / expected).sum()), bins - 1


def statistic(probs: torch.Tensor, tokens: torch.Tensor, t: int) -> tuple[float, int]:
    """Position 0: Pearson over the tokens (one shared distribution); later positions: over the rows' transforms."""
    if t == 0:
        return pearson(torch.bincount(tokens, minlength=probs.shape[1]).double(), probs.sum(0))
    return pit_pearson(probs, tokens)


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, hidden=32, layers=2, seed=0).eval()
    with torch.no_grad():
        model.model.norm.weight.fill_(3.0)  # logits spread out: T = 0.7, T^2 and top-k 50 differ clearly
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # untied: eos's row alone changes
        ids = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
        hidden = model.model(**ids).last_hidden_state[:, -1].mean(0)  # the prompts' mean last hidden state
        model.lm_head.weight[tok.eos_token_id] = 0.15 * hidden / hidden.norm()  # eos first with p ~0.2
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    return model, tok


def draw(model, tok, config: str) -> torch.Tensor:
    """[len(PROMPTS) * N, STEPS] sampled tokens (rows grouped by prompt), -1 after an eos."""
    params = SamplingParams(max_new_tokens=STEPS, temperature=T, n=N, seed=11, batch_size=len(PROMPTS) * N)
    backend = HFBackend(model, tok, **{k: v for k, v in CONFIGS[config].items() if k != "autocast_bf16"})
    backend.autocast_bf16 = CONFIGS[config].get("autocast_bf16", False)
    if config == "multi-turn":
        contexts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS for _ in range(N)]
        rows = backend.generate_ids(contexts, params, seeds=list(range(len(contexts))))
        return torch.tensor([ids + [-1] * (STEPS - len(ids)) for ids, _ in rows])
    ro = backend.generate(PROMPTS, params)
    ids = ro.completion_ids.masked_fill(ro.completion_mask == 0, -1)
    return torch.nn.functional.pad(ids, (0, STEPS - ids.shape[1]), value=-1)


@torch.no_grad()
def exact(model, tok, prompt: str, prefixes: torch.Tensor, temperature: float = T) -> torch.Tensor:
    """[n, V] float64 softmax(logits / temperature) of the next token after `prompt` + each row of `prefixes` [n, k],
    one fp32 forward over the distinct rows (no padding: every row has the same length)."""
    distinct, inverse = (prefixes[:1], torch.zeros(len(prefixes), dtype=torch.long)) if prefixes.shape[1] == 0 else \
        torch.unique(prefixes, dim=0, return_inverse=True)  # fmt: skip
    ids = torch.tensor(tok(prompt, add_special_tokens=False).input_ids).expand(distinct.shape[0], -1)
    logits = model(input_ids=torch.cat([ids, distinct], dim=1)).logits[:, -1].double()
    return torch.softmax(logits / temperature, dim=-1)[inverse]


def top_k(probs: torch.Tensor, k: int = 50) -> torch.Tensor:
    kept = probs.masked_fill(probs < probs.topk(k, dim=-1).values[:, -1:], 0.0)
    return kept / kept.sum(-1, keepdim=True)


def position(model, tok, tokens: torch.Tensor, prompt: str, t: int, temperature: float = T):
    """([n, V] each live row's exact distribution at position t under `temperature`, [n] its drawn token there)."""
    rows = tokens[(tokens[:, : t + 1] >= 0).all(1)]  # no eos before t: the row drew a token at t
    return exact(model, tok, prompt, rows[:, :t], temperature), rows[:, t]


@pytest.fixture(scope="module")
def drawn(setup):
    model, tok = setup
    return {config: draw(model, tok, config) for config in CONFIGS}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sampled_tokens_follow_the_exact_distribution(setup, drawn, config):
    model, tok = setup
    tokens = drawn[config]
    for i, prompt in enumerate(PROMPTS):
        mine = tokens[i * N : (i + 1) * N]
        for t in range(STEPS):
            probs, tokens_t = position(model, tok, mine, prompt, t)
            assert len(tokens_t) > 2000, "the eos bias leaves too few rows to test"
            stat, dof = statistic(probs, tokens_t, t)
            assert stat < chi2_critical(dof), f"{config}, prompt {prompt!r}, position {t}: X^2 {stat:.0f} ({dof} dof)"


def test_the_check_rejects_a_temperature_applied_twice_no_temperature_and_top_k(setup, drawn):
    """The default configuration's counts against wrong distributions: every one is rejected at every position, so
    the checks above would catch a sampler that drew from one of them."""
    model, tok = setup
    tokens = drawn["default"]
    for i, prompt in enumerate(PROMPTS):
        mine = tokens[i * N : (i + 1) * N]
        for t in range(STEPS):
            probs, tokens_t = position(model, tok, mine, prompt, t)
            twice, _ = position(model, tok, mine, prompt, t, temperature=T * T)
            untempered, _ = position(model, tok, mine, prompt, t, temperature=1.0)
            for name, wrong in {"T^2": twice, "T=1": untempered, "top_k 50": top_k(probs)}.items():
                stat, dof = statistic(wrong, tokens_t, t)
                assert stat > chi2_critical(dof), f"{name}, prompt {prompt!r}, position {t}: X^2 {stat:.0f} ({dof} dof)"


def test_critical_value_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for dof in (10, 19, 30, 60, 97):
        assert 1.0 <= chi2_critical(dof) / stats.chi2.isf(1e-6, dof) < 1.025
