"""On-policy distillation: a teacher model's log-probs of the student's sampled tokens as a dense, per-token reward.

The student samples (the rollout stage, unchanged); the teacher, a Hugging Face causal LM with the student's
tokenizer, is run teacher-forced over prompt + sampled completion (one batched forward per `rollout.batch_size`
rows, no generation) and each sampled token t gets

    r_t = log p_teacher(y_t | x, y_<t) - log p_student(y_t | x, y_<t)        (minus the per-token reverse KL)

on the tokens the loss counts (`Rollouts.loss_mask`: environment and tool tokens get none). Its per-token
advantage is r_t itself (`distill.discount` = 0, token-local, as the published recipes do) or the discounted
return sum_k gamma^k r_{t+k} over the completion's later sampled tokens (gamma in (0, 1]). The reward stage adds it
to the verifiers' group advantage: A_t = A_verifiers + distill.weight * A_distill_t, a [N, T] tensor
(`forge.advantages`); with no verifiers A_verifiers is 0 (pure distillation). Nothing is normalised per group: the
reverse KL is already on an absolute scale.

`distill.topk` = k > 0 replaces that sampled-token reward (GKD, Agarwal et al. 2024, with the divergence cut to
the teacher's top k): the teacher also returns its k most likely tokens at each sampled position, and the update adds
`distill.weight` times the exact reverse KL between the student's and the teacher's next-token distributions over
those k tokens and one bucket for the rest (`forge.losses.topk_reverse_kl`; or the forward KL,
`distill.divergence`) to each sampled token's loss. The sampled-token reward only says the student's own
token was unlikely; the divergence names the ones the teacher expected. `distill/reverse_kl` is still reported (from the sampled tokens), beside `distill/topk_kl`.

Where this departs from the recipes it follows (Agarwal et al. 2024, "On-policy distillation of language models";
Gu et al. 2024, MiniLLM; Thinking Machines' "On-policy distillation", 2025): log p_student is the rollout's own
sampling log-prob (the behaviour policy mu, over logits / rollout.temperature), not a recomputation by the trainer,
and the teacher is scored at that temperature too (the recipes sample at 1): on-policy (algo.max_staleness = 0) that
is the reverse KL between the tempered policy being trained and the tempered teacher, 0 for a teacher equal to it.
The teacher runs under the update's precision, like the reference model (`forge.precision.update_bf16`: bf16 on
GPUs, on a CPU only when update.autocast_bf16 asks and it has bf16 units).
A teacher log-prob that is not finite makes that step's loss non-finite, so the trainer skips it and counts it as
it counts any non-finite step (`update.max_skipped_steps`); it is never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from forge.errors import UserError
from forge.model_config import ModelConfig
from forge.models import _load, check_model_dir, default_device, load_tokenizer
from forge.precision import update_bf16
from forge.records import Rollouts, TeacherTopK
from forge.rewards.distill_config import DistillConfig


@dataclass(frozen=True)
class TeacherScores:
    """What the teacher says of a step's rollouts (the loop's teacher stage): the reward stage turns `logp` into
    the per-token distillation advantage, the update's loss adds the KL to `topk`."""

    logp: torch.Tensor  # [N, T] its log-prob of every sampled token
    topk: TeacherTopK | None = None  # [N, T, k] its k most likely tokens at each position, weighted (distill.topk)


class Teacher:
    """A frozen teacher model loaded once for the run; `logprobs(rollouts)` scores a step's sampled tokens."""

    def __init__(self, distill: DistillConfig, model: ModelConfig, *, batch_size: int, temperature: float,
                 autocast_bf16: bool = False):  # fmt: skip
        """Load `distill.teacher`; a missing directory or a tokenizer other than `model`'s (the policy's) is one
        UserError. `batch_size`, `temperature`: the rollout's; `autocast_bf16`: the update's."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path, student_tok = check_teacher_dir(distill.teacher), load_tokenizer(model)
        check_same_vocab(path, _load(AutoTokenizer.from_pretrained, path), student_tok)
        teacher = _load(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32)  # fp32, as the policy
        check_vocab_rows(path, teacher, len(student_tok))
        self.device = default_device()
        self.model = teacher.to(self.device).eval().requires_grad_(False)
        self.bf16 = update_bf16(autocast_bf16, self.device.type)
        self.batch_size, self.temperature = batch_size, temperature
        self.k, self.vocab = distill.topk, len(student_tok)  # top-k ids: the policy's tokens only
        self.weight, self.divergence = distill.weight, distill.divergence  # the loss's top-k term
        if self.k > self.vocab:
            raise UserError(f"distill.topk={self.k} is more than the tokenizer's {self.vocab} tokens: "
                            "lower it (16 covers nearly all of a trained teacher's mass)")  # fmt: skip

    @torch.no_grad()
    def logprobs(self, ro: Rollouts) -> TeacherScores:
        """The teacher's log-prob of every completion token at the sampling temperature (rollout.temperature, the
        one the student's sampling log-probs have), teacher-forced over the whole episode (every real token
        attended), and with distill.topk its top k at each position; read only where `ro.loss_mask` is 1."""
        from forge.trainer import chunked_scores, completion_logits

        logp, ids, top = [], [], []
        for i in range(0, ro.num_completions, self.batch_size):
            sl = slice(i, i + self.batch_size)
            args = (ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl], ro.completion_mask[sl])
            logits = completion_logits(self.model, *(a.to(self.device) for a in args), self.bf16)  # [n, T, V]
            scores = chunked_scores(logits, args[2].to(self.device), self.temperature, self.k, self.vocab)
            logp.append(scores[0].float().cpu())
            if self.k:
                top.append(scores[1].cpu())
                ids.append(scores[2].cpu())
        if not self.k:
            return TeacherScores(torch.cat(logp))
        return TeacherScores(torch.cat(logp), TeacherTopK(torch.cat(ids), torch.cat(top), self.weight, self.divergence))


def check_teacher_dir(path: str) -> str:
    """`path` when it is a local HF model directory (config.json, whole weight files); else one UserError."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"distill.teacher '{path}' does not exist: point it at a local HF causal LM directory")
    if not (p / "config.json").is_file():
        raise UserError(f"distill.teacher '{path}' has no config.json: point it at a local HF causal LM directory")
    check_model_dir(p, fix="point distill.teacher at a whole model directory")
    return str(p)


def check_same_vocab(path: str, teacher_tok, student_tok) -> None:
    """The teacher's tokenizer maps every token to the policy's id; else one UserError naming the path."""
    a, b = teacher_tok.get_vocab(), student_tok.get_vocab()
    if a != b:
        differ = len(set(a.items()) ^ set(b.items()))
        raise UserError(
            f"distill.teacher '{path}' has a different tokenizer from the policy's ({len(a)} vs {len(b)} tokens, "
            f"{differ} entries differ): distillation needs a teacher with the student's tokenizer"
        )


def check_vocab_rows(path: str, model, vocab: int) -> None:
    """The teacher's output layer has a row for every token id of the policy's tokenizer; else one UserError."""
    rows = model.get_output_embeddings().weight.shape[0]
    if rows < vocab:
        raise UserError(f"distill.teacher '{path}' has {rows} output rows for a {vocab}-token tokenizer: "
                        "use a teacher with the student's vocabulary")  # fmt: skip


def distill_rewards(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] r_t = log p_teacher - log p_student on the tokens of `mask`, 0 elsewhere (a non-finite teacher
    log-prob stays non-finite on a masked token: the update then skips the step).

    >>> distill_rewards(torch.tensor([[-1.0, -5.0]]), torch.tensor([[-2.0, -1.0]]), torch.tensor([[1, 0]]))
    tensor([[1., 0.]])
    """
    return torch.where(mask.bool(), teacher_logp - student_logp, 0.0)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[N, T] G_t = r_t + gamma * G_next over the tokens of `mask` (G_next: the next masked token's return; tokens
    outside the mask are skipped and get 0). gamma = 0 is the rewards themselves.

    >>> discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[1, 0, 1]]), 0.5)
    tensor([[2., 0., 2.]])
    """
    if gamma == 0:
        return rewards
    m = mask.bool()
    out, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m[:, t], running, 0.0)
    return out


def distill_advantages(advantages: torch.Tensor, teacher_logp: torch.Tensor, ro: Rollouts, weight: float,
                       gamma: float) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """[N] verifier advantages + weight * the [N, T] distillation advantage, and `distill/reverse_kl`: the mean over
    sampled tokens of log p_student - log p_teacher (NaN when a teacher log-prob there is not finite)."""
    mask = ro.loss_mask
    rewards = distill_rewards(teacher_logp, ro.sampling_logprobs.float(), mask)  # [N, T]
    combined = advantages.float().unsqueeze(1) + weight * discounted_returns(rewards, mask, gamma)  # [N, T]
    m = mask.bool()
    kl = float(-rewards[m].mean()) if m.any() else 0.0
    return combined, {"distill/reverse_kl": kl, **position_profile(-rewards, mask)}


def position_profile(kl: torch.Tensor, mask: torch.Tensor, bins: int = 4) -> dict[str, float]:
    """Where in the completions the student disagrees: `distill/reverse_kl_qK`, the mean of [N, T] `kl` over the
    sampled tokens in the K-th of `bins` equal slices of each completion's sampled tokens (a bin no token falls in is
    left out).

    >>> kl = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 0.0, 0.0, 0.0]])
    >>> mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    >>> position_profile(kl, mask, 2)  # halves: (1 + 2 + 5) / 3 and (3 + 4) / 2
    {'distill/reverse_kl_q1': 2.6666667461395264, 'distill/reverse_kl_q2': 3.5}
    """
    m = mask.bool()
    rank = mask.long().cumsum(1) - 1  # [N, T] index among the row's sampled tokens
    slot = (rank * bins) // mask.long().sum(1, keepdim=True).clamp(min=1)  # [N, T] in [0, bins)
    out = {}
    for k in range(bins):
        sel = m & (slot == k)
        if sel.any():
            out[f"distill/reverse_kl_q{k + 1}"] = float(kl[sel].mean())
    return out
