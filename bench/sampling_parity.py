"""Sampling parity: forgeweave's samplers against `transformers` `generate` on the same weights and prompts.

SmolLM2-135M-Instruct on the `smollm2-arith` preset's task (its held-out split by default, chat-formatted by
`forge.data.build`), P prompts x G samples at T = 0.7, <= 32 new tokens, each sampler seeded alike:

- generate: `model.generate(do_sample=True, temperature=T, top_p=1, top_k=0)` (top_k=0: generate's default top_k
  is 50, which would truncate the distribution the others sample), torch's multinomial over the softmax;
- generate-bf16: the same under bf16 autocast (the preset's precision);
- hf-fp32: forgeweave's hf backend with its default settings (shared prefill, compaction every 4 tokens, the two-stage
  token draw);
- hf-bf16: the same under bf16 autocast (`rollout.autocast_bf16=true`, the `smollm2-arith` preset);
- hf-plain: shared prefill and compaction off (`rollout.shared_prefill=false`, `rollout.compact_every=0`), fp32;
- vllm: the vllm backend, sampled by .venv-vllm's python in a subprocess (this script with --emit), only where that
  venv exists.

Each completion is scored by `math_answer`. Printed per variant: N, the success rate with its Wilson 95% interval,
the ratio to generate's rate at the same precision, whether generate's rate lies in the variant's interval, and
Newcombe's 95% interval of the difference of the two rates. The binomial interval treats the N samples as
independent; on a fixed prompt set the samples are independent given the prompt, and the variance of the pooled rate
is then at most p(1-p)/N, so the interval is conservative. "In CI" is the issue's criterion: two identical samplers
fail it ~17% of the time at equal N (the difference of two rates has sqrt(2) times one rate's SD), so the difference
interval (0 inside for samplers that agree, 95% of the time) is the one to read.

Token level: every sampled sequence is teacher-forced through the model in fp32, giving each sampled token's
distribution softmax(logits / T). Printed: the mean and quantiles of the sampled tokens' log-probs; the calibration
gap mean(log p(x_t) + H_t) with its standard error (for a sampler that draws from exactly the fp32 distribution each
term has mean 0 given its context, so the gap is 0 within ~2 SE; a sharper sampler, e.g. a temperature applied twice
or top-k, has a positive gap, a flatter one a negative gap); and the randomised probability integral transform of
every sampled token (the tokens in order of decreasing probability, u = the mass before the drawn token + v x its
own, v uniform): for an exact sampler the u of all tokens are independent and uniform on [0, 1) (Rosenblatt), so
their counts in 20 bins give a chi-square statistic with 19 dof, sensitive to any systematic departure. For
forgeweave's samplers also the mean of (recorded log-prob - fp32 teacher-forced log-prob), an estimate of
KL(sampler || fp32) per token, and its mean absolute value.

Default size: 64 prompts x 8 samples (N = 512 per variant), ~10 min on one thread of a 2-core machine. Rerun:
  OMP_NUM_THREADS=1 python bench/sampling_parity.py [--prompts 64] [--samples 8] [--tokens 32] [--temperature 0.7]
      [--variants generate,hf-fp32,...] [--split eval|train] [--seed 0] [--out runs/bench-sampling-parity.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PRESET = "smollm2-arith"
VARIANTS = ("generate", "generate-bf16", "hf-fp32", "hf-bf16", "hf-plain", "vllm")
Z95 = 1.959964  # two-sided 95% normal quantile
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
PIT_BINS = 20
PIT_CRITICAL = {0.001: 43.82, 0.05: 30.14}  # chi-square(19) upper quantiles (scipy.stats.chi2.isf)


@dataclass(frozen=True)
class Samples:
    """One sampler's completions, rows grouped by prompt (row i -> prompt i // G)."""

    tokens: list[list[int]]  # [N] each completion's tokens up to and including its first eos
    logprobs: list[list[float]] | None  # [N] the sampler's own log-probs of those tokens (None: not recorded)
    seconds: float
    precision: str  # "fp32" or "bf16" (what actually ran: bf16 falls back to fp32 without bf16 units)


@dataclass
class Report:
    """One variant's figures (the JSON written to --out holds one per variant)."""

    n: int
    successes: int
    rate: float
    wilson95: tuple[float, float]
    precision: str
    seconds: float
    mean_tokens: float
    ended_with_eos: float
    logp: dict = field(default_factory=dict)  # teacher-forced sampled-token log-probs: mean, quantiles, calibration
    baseline: str = ""
    ratio: float | None = None
    baseline_in_interval: bool | None = None
    diff95: tuple[float, float] | None = None  # Newcombe's 95% interval of rate - the baseline's rate


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials.

    >>> [round(x, 4) for x in wilson(10, 100)]
    [0.0552, 0.1744]
    """
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return centre - half, centre + half


def newcombe(p1: float, ci1: tuple[float, float], p2: float, ci2: tuple[float, float]) -> tuple[float, float]:
    """95% interval of p1 - p2 from the two Wilson intervals (Newcombe's hybrid score method, independent samples).

    >>> [round(x, 4) for x in newcombe(0.5, wilson(50, 100), 0.4, wilson(40, 100))]
    [-0.0373, 0.2321]
    """
    d = p1 - p2
    return d - math.hypot(p1 - ci1[0], ci2[1] - p2), d + math.hypot(ci1[1] - p1, p2 - ci2[0])


def n_to_separate(p: float, ratio: float = 1.5, z: float = Z95) -> int:
    """Samples per variant at which rates p and ratio * p have disjoint 95% intervals (normal approximation).

    >>> n_to_separate(0.2)
    283
    """
    q = min(ratio * p, 1.0)
    return math.ceil((z * (math.sqrt(p * (1 - p)) + math.sqrt(q * (1 - q))) / (q - p)) ** 2)


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())


def task(split: str, count: int):
    """(model, tokenizer, chat-formatted prompts, raw prompts, answers) of the preset's first `count` rows."""
    from flows.runs import resolve_config
    from forge.compose import data_sources
    from forge.data import build
    from forge.models import format_prompt_fn, load_policy

    cfg = resolve_config(PRESET, None, [])
    model, tok = load_policy(cfg.model)
    data = build(data_sources(cfg), format_prompt_fn(tok, cfg.model), lambda s: len(tok(s, add_special_tokens=False).input_ids))
    rows = (data.eval if split == "eval" else data.train)[:count]
    return model.eval(), tok, [r["model_input"] for r in rows], [r["prompt"] for r in rows], [r["answer"] for r in rows]


def through_eos(ids: list[int], eos: int) -> list[int]:
    """`ids` up to and including the first eos.

    >>> through_eos([5, 2, 2, 2], 2), through_eos([5, 6], 2)
    ([5, 2], [5, 6])
    """
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def bf16_here(requested: bool) -> bool:
    from forge.precision import bf16_autocast

    return bf16_autocast(requested, "cpu", "bench --variants *-bf16")


def sample_generate(model, tok, prompts: list[str], args, bf16: bool) -> Samples:
    """`transformers` sampling as a user calls it: G return sequences per prompt, top_k disabled, torch's RNG."""
    per_chunk = max(1, args.batch_size // args.samples)
    bf16 = bf16_here(bf16)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        for i in range(0, len(prompts), per_chunk):
            enc = tok(prompts[i : i + per_chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0,
                                     max_new_tokens=args.tokens, num_return_sequences=args.samples,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
            tokens += [through_eos(r, tok.eos_token_id) for r in out[:, enc.input_ids.shape[1] :].tolist()]
    return Samples(tokens, None, time.perf_counter() - start, "bf16" if bf16 else "fp32")


def sample_forge(backend, prompts: list[str], args) -> Samples:
    from forge.rollout import SamplingParams

    params = SamplingParams(args.tokens, args.temperature, n=args.samples, seed=args.seed)
    start = time.perf_counter()
    ro = backend.generate(prompts, params)
    seconds = time.perf_counter() - start
    mask = ro.completion_mask.bool()
    tokens = [ids[m].tolist() for ids, m in zip(ro.completion_ids, mask, strict=True)]
    logprobs = [lp[m].tolist() for lp, m in zip(ro.sampling_logprobs, mask, strict=True)]
    bf16 = getattr(backend, "autocast_bf16", False) or getattr(backend, "dtype", None) == torch.bfloat16  # hf, vllm
    precision = "bf16" if bf16 else "fp32"
    return Samples(tokens, logprobs, seconds, precision)


def sample_vllm(args) -> Samples | None:
    """The vllm backend's samples, drawn by .venv-vllm's python running this script with --emit; None without it."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        print(f"vllm: skipped ({python.relative_to(ROOT)} does not exist: `make vllm-env` creates it)", flush=True)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        argv = [str(python), __file__, "--emit", str(out), "--variants", "vllm", *forwarded(args)]
        subprocess.run(argv, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return Samples(**json.loads(out.read_text()))


def forwarded(args) -> list[str]:
    keys = ("prompts", "samples", "tokens", "temperature", "split", "seed", "batch_size", "threads")
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]


def draw(name: str, model, tok, prompts: list[str], args) -> Samples | None:
    from forge.config import RolloutConfig
    from forge.rollout import HFBackend, make_backend

    if name.startswith("generate"):
        return sample_generate(model, tok, prompts, args, bf16=name.endswith("bf16"))
    if name == "vllm":
        if not args.emit:
            return sample_vllm(args)
        engine = make_backend("vllm", model, tok, rollout=RolloutConfig(backend="vllm"))  # inside .venv-vllm
        engine.sync_weights({k: v.detach() for k, v in model.state_dict().items()}, 0)  # it starts from dummy weights
        return sample_forge(engine, prompts, args)
    plain = name == "hf-plain"
    backend = HFBackend(model, tok, autocast_bf16=name == "hf-bf16", batch_size=args.batch_size,
                        shared_prefill=not plain, compact_every=0 if plain else RolloutConfig().compact_every)  # fmt: skip
    return sample_forge(backend, prompts, args)


@dataclass(frozen=True)
class Forced:
    """The fp32 teacher-forced view of one sampler's tokens, flattened over all rows' tokens in order ([tokens])."""

    logp: torch.Tensor  # log-prob of the sampled token under softmax(logits / T), float64
    entropy: torch.Tensor  # entropy of that distribution
    pit: torch.Tensor  # randomised probability integral transform: uniform on [0, 1) for an exact sampler
    position: torch.Tensor  # the token's place in its completion (0 = first)


@torch.no_grad()
def teacher_forced(model, tok, prompts: list[str], tokens: list[list[int]], args) -> Forced:
    """Every sampled token's fp32 distribution given its prompt and prefix, one group per forward, packed (its prompt
    once, padding-free: `forge.shared_prefix`), so the attention spans one group's tokens only."""
    from forge.shared_prefix import PackingCost, pack, packed_logits

    G, kind = args.samples, PackingCost.of(model).mask_kind
    gen = torch.Generator().manual_seed(args.seed)
    parts = []
    for i, prompt in enumerate(prompts):
        enc = tok([prompt] * G, return_tensors="pt", add_special_tokens=False)
        rows = tokens[i * G : (i + 1) * G]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])  # [G, T]
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        packed = pack(enc.input_ids, enc.attention_mask, ids, mask, [(0, G)])
        logits = packed_logits(model, packed, kind, torch.float32)[0]  # [C, V], C = the group's sampled tokens
        logsm = torch.log_softmax(logits.float() / args.temperature, dim=-1).double()
        target = packed.targets[0]
        parts.append((*token_view(logsm, target, gen), torch.arange(width).expand(G, width)[mask.bool()]))
    logp, entropy, pit, position = (torch.cat(x) for x in zip(*parts, strict=True))
    return Forced(logp, entropy, pit, position)


def token_view(logsm: torch.Tensor, target: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """[C] the targets' log-probs, the entropies and the randomised PITs of the rows of `logsm` [C, V]: with the
    tokens in order of decreasing probability, u = the mass before the target + v x its own, v uniform."""
    probs = logsm.exp()
    logp = logsm.gather(-1, target[:, None]).squeeze(-1)
    entropy = -(probs * logsm).sum(-1)
    above = (probs * (probs > probs.gather(-1, target[:, None]))).sum(-1)  # mass of the more likely tokens
    ties = (probs == probs.gather(-1, target[:, None])).sum(-1)  # equal ones share the target's slot, at random
    own = logp.exp()
    u = above + torch.rand(len(target), generator=gen, dtype=torch.float64) * own * ties
    return logp, entropy, u.clamp(0.0, 1.0 - 1e-12)


def pit_chi_square(pit: torch.Tensor, bins: int = PIT_BINS) -> float:
    """Pearson's statistic of the PITs in `bins` equal bins against uniform (chi-square with bins - 1 dof)."""
    counts = torch.bincount((pit * bins).long(), minlength=bins).double()
    expected = len(pit) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def token_figures(samples: Samples, f: Forced) -> dict:
    """The sampled tokens' teacher-forced log-prob distribution, calibration gap and PIT (see the module docstring)."""
    gap = f.logp + f.entropy  # [tokens] mean 0 for an exact sampler
    first = f.position == 0
    out = {
        "tokens": int(f.logp.numel()),
        "mean": float(f.logp.mean()),
        "quantiles": {str(q): float(f.logp.quantile(q)) for q in QUANTILES},
        "mean_entropy": float(f.entropy.mean()),
        "gap": float(gap.mean()),
        "gap_se": float(gap.std() / math.sqrt(gap.numel())),
        "gap_first": float(gap[first].mean()),
        "gap_first_se": float(gap[first].std() / math.sqrt(int(first.sum()))),
        "pit_chi2": pit_chi_square(f.pit),
        "pit_chi2_first": pit_chi_square(f.pit[first]),
    }
    if samples.logprobs is not None:
        diff = torch.tensor([x for row in samples.logprobs for x in row], dtype=torch.float64) - f.logp
        out["recorded_minus_fp32_mean"] = float(diff.mean())  # estimates KL(sampler || fp32) where they differ
        out["recorded_vs_fp32_mean_abs"], out["recorded_vs_fp32_max_abs"] = (
            float(diff.abs().mean()),
            float(diff.abs().max()),
        )
    return out


def score(tok, samples: Samples, raw_prompts: list[str], answers: list[str], G: int) -> list[float]:
    from forge.rewards.verifiers import math_answer

    texts = [tok.decode(t, skip_special_tokens=True) for t in samples.tokens]
    return [float(x or 0.0) for x in math_answer([p for p in raw_prompts for _ in range(G)], texts,
                                                 answer=[a for a in answers for _ in range(G)])]  # fmt: skip


def report(samples: Samples, rewards: list[float], tokens: dict, eos: int) -> Report:
    n, k = len(rewards), int(sum(rewards))
    return Report(
        n=n, successes=k, rate=k / n, wilson95=wilson(k, n), precision=samples.precision, seconds=samples.seconds,
        mean_tokens=sum(map(len, samples.tokens)) / n,
        ended_with_eos=sum(bool(t) and t[-1] == eos for t in samples.tokens) / n, logp=tokens,
    )  # fmt: skip


def compare(reports: dict[str, Report]) -> None:
    """Each variant against generate at its own precision (generate-bf16 for bf16 samplers, where it ran)."""
    for name, r in reports.items():
        base = "generate-bf16" if r.precision == "bf16" and "generate-bf16" in reports else "generate"
        if name == base or base not in reports:
            continue
        b = reports[base]
        r.baseline, r.ratio = base, (r.rate / b.rate if b.rate else None)
        r.baseline_in_interval = r.wilson95[0] <= b.rate <= r.wilson95[1]
        r.diff95 = newcombe(r.rate, r.wilson95, b.rate, b.wilson95)


def print_table(reports: dict[str, Report], args) -> None:
    print(f"\n{'variant':<15}{'prec':>5}{'N':>6}{'success':>9}{'Wilson 95%':>18}{'vs':>15}{'ratio':>7}{'in CI':>7}"
          f"{'diff 95% (Newcombe)':>22}{'s':>7}{'len':>6}{'eos':>6}")  # fmt: skip
    for name, r in reports.items():
        ci = f"[{r.wilson95[0]:.3f}, {r.wilson95[1]:.3f}]"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        inside = "" if r.baseline_in_interval is None else ("yes" if r.baseline_in_interval else "NO")
        diff = "" if r.diff95 is None else f"[{r.diff95[0]:+.3f}, {r.diff95[1]:+.3f}]"
        print(f"{name:<15}{r.precision:>5}{r.n:>6}{r.rate:>9.3f}{ci:>18}{r.baseline:>15}{ratio:>7}{inside:>7}"
              f"{diff:>22}{r.seconds:>7.0f}{r.mean_tokens:>6.1f}{r.ended_with_eos:>6.2f}")  # fmt: skip
    print(f"\nsampled tokens' fp32 teacher-forced log-probs at T={args.temperature} (gap = mean(log p + H), 0 for an "
          f"exact sampler; PIT X^2: 19 dof, {PIT_CRITICAL[0.05]} at p=0.05, {PIT_CRITICAL[0.001]} at p=0.001; first = "
          "first completion token only; rec-fp32: the sampler's recorded log-prob minus the fp32 one)")  # fmt: skip
    head = "".join(f"{'q' + str(q):>8}" for q in QUANTILES)
    print(f"{'variant':<15}{'tokens':>7}{'mean':>8}{head}{'gap ± SE':>18}{'first ± SE':>18}{'PIT X^2':>9}"
          f"{'first':>7}{'rec-fp32':>10}{'|rec-fp32|':>12}")  # fmt: skip
    for name, r in reports.items():
        t = r.logp
        quant = "".join(f"{t['quantiles'][str(q)]:>8.3f}" for q in QUANTILES)
        gap, first = f"{t['gap']:+.4f} ± {t['gap_se']:.4f}", f"{t['gap_first']:+.4f} ± {t['gap_first_se']:.4f}"
        rec = (f"{t['recorded_minus_fp32_mean']:>+10.1e}{t['recorded_vs_fp32_mean_abs']:>12.1e}"
               if "recorded_vs_fp32_mean_abs" in t else "")  # fmt: skip
        print(f"{name:<15}{t['tokens']:>7}{t['mean']:>8.3f}{quant}{gap:>18}{first:>18}{t['pit_chi2']:>9.1f}"
              f"{t['pit_chi2_first']:>7.1f}{rec}")  # fmt: skip


def print_power(reports: dict[str, Report], n: int) -> dict:
    base = reports.get("generate") or next(iter(reports.values()))
    need = n_to_separate(base.rate) if 0 < base.rate < 2 / 3 else None
    half = (base.wilson95[1] - base.wilson95[0]) / 2
    print(f"\npower: N = {n} per variant; at generate's rate {base.rate:.3f} the Wilson 95% interval is "
          f"±{half:.3f}; a 1.5x difference ({base.rate:.3f} vs {1.5 * base.rate:.3f}) needs N >= {need} for "
          f"disjoint intervals: {'separable' if need and n >= need else 'NOT separable'} at this N")  # fmt: skip
    return {"n": n, "rate": base.rate, "half_width": half, "n_for_1.5x": need}


def machine() -> dict:
    from forge.precision import bf16_fast

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "bf16_units": bf16_fast("cpu"),
            "threads": torch.get_num_threads(), "torch": torch.__version__}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="P (the split has 200 eval / 2000 train rows)")
    ap.add_argument("--samples", type=int, default=8, help="G per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="max new tokens")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--split", choices=["eval", "train"], default="eval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64, help="rows per generate call (whole groups)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-sampling-parity.json")
    ap.add_argument("--emit", type=Path, help=argparse.SUPPRESS)  # internal: write one variant's samples, no scoring
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, tok, prompts, raw, answers = task(args.split, args.prompts)
    if args.emit:
        samples = draw(args.variants, model, tok, prompts, args)
        args.emit.write_text(json.dumps(asdict(samples)))
        return
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, bf16 units: {'yes' if info['bf16_units'] else 'no'}; "
          f"{info['threads']} thread(s); {len(prompts)} {args.split} prompts x {args.samples} samples, "
          f"<= {args.tokens} new tokens, T={args.temperature}, seed {args.seed}", flush=True)  # fmt: skip
    reports: dict[str, Report] = {}
    for name in args.variants.split(","):
        samples = draw(name, model, tok, prompts, args)
        if samples is None:
            continue
        figures = token_figures(samples, teacher_forced(model, tok, prompts, samples.tokens, args))
        reports[name] = report(samples, score(tok, samples, raw, answers, args.samples), figures, tok.eos_token_id)
        r = reports[name]
        print(f"  {name}: {r.successes}/{r.n} = {r.rate:.3f} in {r.seconds:.0f} s", flush=True)
    compare(reports)
    print_table(reports, args)
    power = print_power(reports, len(prompts) * args.samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "emit"}
    result = {
        "machine": info,
        "settings": settings,
        "power": power,
        "variants": {k: asdict(v) for k, v in reports.items()},
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
