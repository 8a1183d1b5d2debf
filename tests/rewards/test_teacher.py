"""On-policy distillation (forge/rewards/teacher.py): a teacher's log-probs of the sampled tokens as a per-token
reward in the reward stage, and what the update does with it.

Teachers are tiny Llamas saved next to the test: the student's own weights (teacher == student), a copy edited to
prefer one token everywhere (`prefers`), one with NaN weights, one with another tokenizer.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from forge.compose import reward_worker, teacher
from forge.config import ConfigError, RunConfig
from forge.errors import UserError
from forge.losses import TOPK_DIVERGENCES
from forge.models import build_char_tokenizer, build_tiny_model, load_policy
from forge.rewards.teacher import discounted_returns
from forge.trainer import token_logprobs
from tests.grpo_parts import Trainer
from tests.test_trainer import PROMPTS, T, make_rollouts

torch.set_num_threads(1)

X = "7"  # the token the edited teacher prefers


def save(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def prefers(model, tok, token: str, gap: float = 1.0):
    """A copy of `model` whose next-token distribution puts most mass on `token` at every position: hidden dim 0
    holds a constant c (every embedding's column 0; no layer writes to it), so after the final RMSNorm it is about
    sqrt(hidden) everywhere, and token's (tied) embedding row carries c + gap there: its logit leads every other
    token's by about gap * sqrt(hidden) / c * c = gap * sqrt(hidden) nats."""
    m = copy.deepcopy(model)
    c, x = 20.0, tok.convert_tokens_to_ids(token)
    with torch.no_grad():
        emb = m.get_input_embeddings().weight
        emb[:, 0] = c
        emb[x, 0] = c + gap
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
    return m


def distill_cfg(teacher: str, **distill) -> RunConfig:
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.rollout.temperature = T, 1.0
    cfg.model.tiny.hidden, cfg.model.tiny.layers = 32, 1
    cfg.update.adaptive.enabled, cfg.update.max_grad_norm = False, 0.0
    cfg.reward.verifiers, cfg.distill.teacher = [], teacher
    for k, v in distill.items():
        setattr(cfg.distill, k, v)
    return cfg


@pytest.fixture()
def student(tok):
    return build_tiny_model(tok, hidden=32, layers=1, seed=0)


def rows():
    return [{"prompt": p, "answer": str(eval(p[:-1]))} for p in PROMPTS]  # 1+2= -> 3


def scored(cfg: RunConfig, ro):
    """The teacher stage's scores of `ro` and the reward stage's batch made with them (step 1)."""
    scores = teacher(cfg).logprobs(ro)
    return reward_worker(cfg).score(rows(), ro, 1, scores), scores


def on_policy(model, ro, temperature: float = 1.0):
    """The rollouts with the sampler's log-probs those of `model` at `temperature` (what it sampled them with)."""
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        logp = token_logprobs(model, *args, temperature=temperature).logp
    return dataclasses.replace(ro, sampling_logprobs=logp * ro.completion_mask)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_equal_to_student_gives_zero_reverse_kl_and_zero_gradient(tok, student, tmp_path, temperature):
    """At any sampling temperature: the teacher is scored at the rollout's temperature, as the student sampled."""
    cfg = distill_cfg(save(student, tok, tmp_path / "teacher"))
    cfg.rollout.temperature = temperature
    ro = on_policy(student, make_rollouts(tok), temperature)
    batch, scores = scored(cfg, ro)
    assert batch.advantages.shape == ro.completion_ids.shape  # [N, T]: per token
    assert batch.reward_metrics["distill/reverse_kl"] == 0.0 and scores.topk is None
    assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages))
    stats = Trainer(copy.deepcopy(student), cfg, total_steps=1).update(ro, batch.advantages)
    assert stats.grad_norm == 0.0 and stats.skipped == 0  # the distillation term has no gradient


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_topk_divergence_equal_teacher_zero_and_full_vocabulary_exact(tok, student, tmp_path, divergence):
    """distill.topk: the sampled-token term leaves the advantages and the update adds the teacher's top-k
    KL. A teacher equal to the student: 0 and no gradient (against a far teacher's). With k = the whole vocabulary
    (no rest bucket) it is the exact KL, sum_v q (log q - log p) (reverse) or sum_v p (log p - log q) (forward), at
    every loss token."""
    ro = on_policy(student, make_rollouts(tok))
    m = ro.loss_mask.bool()
    stats = {}
    for name, model in (("same", student), ("far", prefers(student, tok, X))):
        cfg = distill_cfg(save(model, tok, tmp_path / name), topk=8, weight=0.5,
                          divergence=divergence)  # fmt: skip
        batch, scores = scored(cfg, ro)
        top = scores.topk  # the teacher stage's, for the update's loss (not in the reward stage's record)
        assert top.ids.shape == top.logp.shape == (*ro.completion_ids.shape, 8) and top.weight == 0.5
        assert top.divergence == divergence
        assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages))  # replaced by the loss term
        stats[name] = Trainer(copy.deepcopy(student), cfg, total_steps=1).update(ro, batch.advantages, top)
    assert stats["same"].teacher_kl == pytest.approx(0.0, abs=1e-6) and stats["far"].teacher_kl > 0.3  # weighted 0.5
    assert stats["same"].grad_norm < 1e-4 * stats["far"].grad_norm, (stats["same"].grad_norm, stats["far"])

    teacher, vocab = prefers(student, tok, X), len(tok)
    cfg = distill_cfg(save(teacher, tok, tmp_path / "all"), topk=vocab)
    top = scored(cfg, ro)[1].topk
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    every = torch.arange(vocab).expand(*ro.completion_ids.shape, vocab)
    with torch.no_grad():
        q, p = (token_logprobs(model, *args, extra_ids=every).extra for model in (student, teacher))  # [N, T, V]
        student_top = token_logprobs(student, *args, extra_ids=top.ids).extra
    exact = (q.exp() * (q - p)).sum(-1) if divergence == "reverse" else (p.exp() * (p - q)).sum(-1)
    torch.testing.assert_close(TOPK_DIVERGENCES[divergence](student_top, top.logp)[m], exact[m], atol=1e-5, rtol=1e-4)
    assert exact[m].min() > 1.0


def test_topk_distillation_needs_a_token_local_objective():
    with pytest.raises(ConfigError, match=r"'distill.topk' is set, but .* distill.discount=0") as e:
        distill_cfg("t", topk=4, discount=0.9).validate()
    assert "\n" not in str(e.value)


def test_reward_is_the_log_ratio_on_sampled_tokens_weighted_beside_verifiers(tok, student, tmp_path):
    """r_t = log p_teacher - log p_student on loss tokens only; A = A_verifiers + weight * r (discount 0)."""
    teacher = prefers(student, tok, X)
    ro = on_policy(student, make_rollouts(tok))
    ro = dataclasses.replace(ro, loss_mask=ro.completion_mask * torch.tensor([[1, 0, 1, 1]]))  # position 1: env
    cfg = distill_cfg(save(teacher, tok, tmp_path / "teacher"), weight=0.5)
    cfg.reward.verifiers = ["math_answer"]
    batch, _ = scored(cfg, ro)
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
    with torch.no_grad():
        r = (token_logprobs(teacher, *args).logp - ro.sampling_logprobs) * ro.loss_mask
    verifier_adv = batch.advantages[:, 1]  # position 1 carries no distillation term: the verifier's advantage
    torch.testing.assert_close(batch.advantages, verifier_adv[:, None] + 0.5 * r)
    m = ro.loss_mask.bool()
    assert batch.reward_metrics["distill/reverse_kl"] == pytest.approx(float(-r[m].mean()), rel=1e-5)
    assert batch.reward_metrics["distill/reverse_kl"] > 1.0  # the student is far from the edited teacher
    assert not torch.equal(verifier_adv, torch.zeros_like(verifier_adv))  # one right, one wrong answer per group
    # where in the completions the student disagrees; at most 3 sampled tokens a row here: no 4th quarter
    profile = {k: v for k, v in batch.reward_metrics.items() if k.startswith("distill/reverse_kl_q")}
    assert sorted(profile) == [f"distill/reverse_kl_q{k}" for k in (1, 2, 3)] and min(profile.values()) > 0


def test_discounted_return_sums_later_sampled_tokens():
    r = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[1, 1, 0, 1]])  # position 2: an environment token, skipped
    # gamma 0.5: G_3 = 8, G_1 = 2 + 0.5 * 8 = 6, G_0 = 1 + 0.5 * 6 = 4
    assert discounted_returns(r, mask, 0.5).tolist() == [[4.0, 6.0, 0.0, 8.0]]
    assert discounted_returns(r, mask, 1.0).tolist() == [[11.0, 10.0, 0.0, 8.0]]
    assert discounted_returns(r, mask, 0.0) is r  # token-local


def test_non_finite_teacher_log_probs_skip_the_step(tok, student, tmp_path):
    broken = copy.deepcopy(student)
    with torch.no_grad():
        broken.get_input_embeddings().weight.fill_(math.nan)
    cfg = distill_cfg(save(broken, tok, tmp_path / "teacher"))
    ro = on_policy(student, make_rollouts(tok))
    batch, _ = scored(cfg, ro)
    assert math.isnan(batch.reward_metrics["distill/reverse_kl"])
    policy = copy.deepcopy(student)
    stats = Trainer(policy, cfg, total_steps=1).update(ro, batch.advantages)
    assert stats.skipped == 1  # counted as any non-finite step (train/skipped_steps), not trained on
    for a, b in zip(policy.parameters(), student.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_teachers_are_one_line_errors(tok, student, tmp_path):
    with pytest.raises(UserError, match=r"distill.teacher '.*nowhere' does not exist") as e:
        teacher(distill_cfg(str(tmp_path / "nowhere")))
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        teacher(distill_cfg(str(tmp_path / "empty")))
    other = build_char_tokenizer()
    other.add_tokens(["<tool>"])
    with pytest.raises(UserError, match="different tokenizer from the policy's") as e:
        teacher(distill_cfg(save(student, other, tmp_path / "other")))
    assert "\n" not in str(e.value) and "other" in str(e.value)
    with pytest.raises(UserError, match=r"distill.topk=1000 is more than the tokenizer's \d+ tokens"):
        teacher(distill_cfg(save(student, tok, tmp_path / "same"), topk=1000))
    with pytest.raises(ConfigError, match="reward.verifiers"):  # no verifier and no teacher: nothing to learn from
        distill_cfg("").validate()
    cfg = distill_cfg("t")
    cfg.reward.aggregate = "ensemble"
    with pytest.raises(ConfigError, match="reward.aggregate=ensemble combines verifiers"):
        cfg.validate()


def run_cfg(steps: int) -> RunConfig:
    """A short in-process run on one-digit sums: B = 4 prompts, G = 4, 3 tokens each, pure distillation."""
    cfg = distill_cfg("")
    cfg.model.chat_template = False
    cfg.data.digits, cfg.data.operations, cfg.data.max_result = 1, ["+"], 9
    cfg.data.prompt_template, cfg.data.train_size, cfg.data.eval_size = "{a}{op}{b}=", 40, 4
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 4, 3
    cfg.steps, cfg.update.lr, cfg.update.max_grad_norm = steps, 1e-2, 1.0
    cfg.eval.every, cfg.eval.k, cfg.eval.max_problems, cfg.eval.verifiers = 0, 0, 4, ["format_integer"]
    cfg.checkpoint.every, cfg.tracking.mlflow = 0, False
    return cfg


def reverse_kls(run_dir) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["distill/reverse_kl"] for m in lines if "distill/reverse_kl" in m]


def test_a_teacher_equal_to_the_sampling_policy_gives_zero_reverse_kl_in_a_run(tmp_path):
    """The sampler's log-probs (hf generate, temperature 1, KV cache) and the teacher's teacher-forced forward of
    the same weights agree up to float rounding: the first step's reverse KL is 0."""
    from forge.api import train

    cfg = run_cfg(1)
    start, tok = load_policy(cfg.model, seed=cfg.seed)
    cfg.distill.teacher = save(start, tok, tmp_path / "teacher")
    train(cfg, run_dir=tmp_path / "run", progress=False)
    assert reverse_kls(tmp_path / "run") == [pytest.approx(0.0, abs=1e-5)]


def test_distillation_raises_the_preferred_tokens_probability(tmp_path):
    """forge.train, pure distillation from a teacher that prefers X: the student's probability of X as the next
    token after a few prompts rises from ~1/V (chance: 1/99 = 0.010) in 30 steps, and the reverse KL falls.

    Measured 2026-12-05 (`python bench/seed_spread.py --scenarios teacher --seeds 0,1,2,3,4,5,6,7`, ~7 s a run; the seed
    draws the student and so the teacher edited from it), p(X) before -> after and reverse KL first -> last step:
    seed 0 0.010 -> 0.82, 6.7 -> 0.99; 1 0.008 -> 0.96, 6.7 -> 0.03; 2 0.011 -> 0.99, 6.2 -> 0.02; 3 0.011 -> 0.98,
    6.7 -> 0.25; 4 0.010 -> 0.98, 6.7 -> 0.06; 5 0.009 -> 0.99, 6.5 -> -0.01; 6 0.011 -> 0.99, 6.5 -> 0.16;
    7 0.009 -> 0.87, 6.7 -> 0.96. The test runs seed 0 (the worst) and asks p(X) > 0.6 and the KL below half its
    first value (worst: 0.96 / 6.7)."""
    from forge.api import train

    cfg = run_cfg(30)
    start, tok = load_policy(cfg.model, seed=cfg.seed)
    cfg.distill.teacher = save(prefers(start, tok, X, gap=2.0), tok, tmp_path / "teacher")
    train(cfg, run_dir=tmp_path / "run", progress=False)
    end, _ = load_policy(dataclasses.replace(cfg.model, path=str(tmp_path / "run/checkpoints/step-000030")))
    prompts = tok(["1+2=", "4+4=", "3+5=", "0+6="], return_tensors="pt")
    x = tok.convert_tokens_to_ids(X)
    with torch.no_grad():
        before, after = (float(m.eval()(**prompts).logits[:, -1].softmax(-1)[:, x].mean()) for m in (start, end))
    assert before < 0.05 and after > 0.6, (before, after)
    kl = reverse_kls(tmp_path / "run")
    assert len(kl) == 30 and kl[-1] < kl[0] / 2, kl


def test_topk_distillation_names_the_token_the_sampled_reward_has_to_find(tmp_path):
    """The same run with distill.topk = 8, 10 steps: the divergence names X at every position, so p(X) rises
    at once (measured 0.010 -> 0.53; 1.000 after 30 steps), where the sampled-token reward has barely moved yet
    (0.010 -> 0.010; 0.82 after 30 steps) because X must first be sampled to be rewarded.

    Measured 2026-12-05 (`python bench/seed_spread.py --scenarios topk --seeds 0,1,2,3,4,5,6,7`, ~8 s for both
    runs), p(X) after 10 steps with the sampled-token reward / with the top 8, and the top-8 run's reverse KL first
    -> last: seed 0 0.010 / 0.53, 6.7 -> 2.8; 1 0.029 / 0.55, 6.7 -> 3.5; 2 0.068 / 0.58, 6.2 -> 3.2; 3 0.039 / 0.57,
    6.7 -> 3.2; 4 0.037 / 0.61, 6.7 -> 3.3; 5 0.048 / 0.61, 6.5 -> 3.1; 6 0.050 / 0.63, 6.5 -> 3.0; 7 0.022 /
    0.63, 6.7 -> 2.9 (chance: p(X) = 1/99 = 0.010, the KL unchanged). Asked: the top 8 above 0.45 (worst 0.53),
    the sampled-token reward below 0.1 (worst 0.068), the KL below 0.65 of its first value (worst 3.5 / 6.7 = 0.53)."""
    from forge.api import train

    after = {}
    for k in (0, 8):
        cfg = run_cfg(10)
        cfg.distill.topk = k
        start, tok = load_policy(cfg.model, seed=cfg.seed)
        cfg.distill.teacher = save(prefers(start, tok, X, gap=2.0), tok, tmp_path / f"teacher-{k}")
        train(cfg, run_dir=tmp_path / f"run-{k}", progress=False)
        end, _ = load_policy(dataclasses.replace(cfg.model, path=str(tmp_path / f"run-{k}/checkpoints/step-000010")))
        prompts = tok(["1+2=", "4+4=", "3+5=", "0+6="], return_tensors="pt")
        with torch.no_grad():
            after[k] = float(end.eval()(**prompts).logits[:, -1].softmax(-1)[:, tok.convert_tokens_to_ids(X)].mean())
        metrics = [json.loads(line) for line in (tmp_path / f"run-{k}/metrics.jsonl").read_text().splitlines()]
        assert ("distill/topk_kl" in metrics[1]) == (k > 0)  # [0]: the eval before step 1
    assert after[8] > 0.45 and after[0] < 0.1, after
    kl = reverse_kls(tmp_path / "run-8")
    assert kl[-1] < 0.65 * kl[0], kl
