"""Named, frozen records that cross stage boundaries.

Legend used in shape comments everywhere: B prompts, G samples per prompt, N = B*G completions,
T completion tokens (right-padded), P prompt tokens (left-padded), V verifiers.

An episode is one token sequence: the prompt, then its completion region, which holds every token after the prompt:
the segments the policy sampled and, in a multi-turn episode, the environment's and tools' segments between them
(`forge.env`). `completion_mask` covers all of them (attention); `loss_mask` only the sampled ones (the loss). In a
single-turn rollout the two are equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from forge.losses import LossOutput

SAMPLES_PER_STEP = 8  # a step's first rows, whose samples (and tokens) samples.jsonl keeps


@dataclass(frozen=True)
class SamplingParams:
    """How a rollout call samples (`forge.rollout.base.RolloutBackend.generate`)."""

    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    n: int = 1  # completions per prompt (G)
    seed: int | None = None  # sampling seed chosen by the caller (None: the process's RNG); greedy ignores it
    batch_size: int | None = None  # sequences per generate() call (hf); None: the backend's own (rollout.batch_size)
    # this call's first row in its step, when the Ray adapter splits a step between replicas (it also shifts `seed` by
    # it); an unseeded multi-turn call offsets its one RNG draw likewise (forge.env.episode.episode_seeds)
    first_row: int = 0


@dataclass(frozen=True)
class Rollouts:
    """Completions sampled by a rollout backend for one step. Rows are grouped: row i belongs to prompt i // G."""

    prompt_ids: torch.Tensor  # [N, P] left-padded prompt token ids
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded episode tokens after the prompt (eos included when sampled)
    completion_mask: torch.Tensor  # [N, T] 1 on every real token after the prompt (sampled and environment/tool)
    sampling_logprobs: torch.Tensor  # [N, T] log-prob of each sampled token under the sampler (0 elsewhere)
    texts: list[str]  # [N] decoded completions, special tokens stripped (multi-turn: the episode after the prompt)
    finish_reasons: list[str]  # [N] "stop" (eos sampled), "length" (hit max_new_tokens or an episode limit) or
    # "error" (the episode's environment failed: an OpenEnv server gone)
    group_size: int  # G
    policy_version: int  # version of the weights that sampled these
    prompts: list[str] = field(default_factory=list)  # [N] prompt text as given to the model (template applied)
    seconds: float = 0.0  # the sampler's own time for this batch (its busy time, not the caller's wait)
    loss_mask: torch.Tensor | None = None  # [N, T] 1 only on tokens the policy sampled; None given = completion_mask
    episodes: Episodes | None = None  # multi-turn: per-episode counts and transcripts; None = single-turn
    single_turn: bool = field(init=False, default=True)  # no loss mask was given: it is the completion mask

    def __post_init__(self):
        object.__setattr__(self, "single_turn", self.loss_mask is None)
        if self.loss_mask is None:  # single-turn: every real completion token was sampled
            object.__setattr__(self, "loss_mask", self.completion_mask)

    @property
    def num_completions(self) -> int:
        return self.completion_ids.shape[0]


@dataclass(frozen=True)
class TokenSequence:
    """One training sequence of token ids: a prompt, then the tokens after it (`Episodes.more_sequences`)."""

    prompt_ids: list[int]
    ids: list[int]  # after the prompt: sampled tokens and what the environment or agent added between them
    loss: list[int]  # 1 on sampled tokens (all 0 in an episode taken out of the loss)
    logprobs: list[float]  # sampling log-probs, 0 off the sampled tokens
    turns: int = 1  # policy turns (requests) in it


@dataclass(frozen=True)
class Episodes:
    """Per-episode figures of a multi-turn rollout, one entry per row of its `Rollouts` ([N] each)."""

    turns: list[int]  # sampled segments (policy turns)
    tool_calls: list[int]  # tool calls the policy made
    tool_errors: list[int]  # calls answered with an error (malformed, unknown tool, raised, timed out)
    truncated: list[bool]  # cut by a limit (max_turns, the token budget, the wall limit), not ended by the policy
    seconds: list[float]  # seconds spent in the environment and tools
    policy_versions: list[list[int]]  # the policy version that sampled each turn
    transcripts: list[list[dict]]  # segments in order: {"role": "environment" (reset's
    # first observation, in the prompt) | "assistant" | "tool" | "user", "content": text}
    masked: list[bool] = field(default_factory=list)  # taken out of the loss: truncated (env.mask_truncated) or failed
    environments: list = field(default_factory=list)  # the episodes' environment instances (reward functions read
    # them as TRL's `environments=`); in Ray mode they travel pickled with the record to the reward actor
    failures: list[str] = field(default_factory=list)  # why the environment failed each episode ('' = it did not):
    # a failed episode is out of the loss (masked) and unscored by the reward stage
    cut_turns: list[int] = field(default_factory=list)  # policy turns cut by rollout.max_new_tokens (no eos sampled)
    # agent episodes (env.agent, forge.env.agent); empty otherwise: chat completion requests answered; prefix breaks,
    # requests whose prompt extends no earlier request's prompt and reply (history rewritten), each starting a
    # training sequence of its own; and those sequences, after the episode's row (the first), trained with the
    # episode's one advantage (forge.sequences)
    requests: list[int] = field(default_factory=list)
    prefix_breaks: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)  # agent episodes: requests answered with an error (malformed,
    # unsupported, past a limit)
    timed_out: list[bool] = field(default_factory=list)  # agent episodes: failed past env.agent.timeout_s
    more_sequences: list[list[TokenSequence]] = field(default_factory=list)

    @staticmethod
    def concat(parts: list[Episodes | None]) -> Episodes | None:
        """One record from several replicas' (all multi-turn, or all None)."""
        if all(p is None for p in parts):
            return None
        assert all(p is not None for p in parts), "multi-turn and single-turn rollouts cannot be concatenated"
        names = [f.name for f in dataclasses.fields(Episodes)]
        return Episodes(**{k: [x for p in parts for x in getattr(p, k)] for k in names})


@dataclass(frozen=True)
class RolloutRequest:
    """What one step's rollout samples: B prompt rows, G completions each, from policy `policy_version`, seeded
    from (run seed, step) by the loop so a retried or resumed step samples the same batch."""

    step: int
    rows: list[dict]  # [B] the prompt rows (every data column: the reward stage reads them)
    prompts: list[str]  # [B] the model inputs (chat template applied)
    params: SamplingParams  # n = G, the seed
    policy_version: int  # the weights it must be sampled from (the trainer's when it was made)


@dataclass(frozen=True)
class ScoredBatch:
    """What the reward stage returns for a step's rollouts: scores, rewards and advantages."""

    verifier_names: list[str]  # [V]
    scores: torch.Tensor  # [N, V] per-verifier scores; NaN where a verifier failed or returned None
    rewards: torch.Tensor  # [N] aggregated reward
    advantages: torch.Tensor  # [N] per-completion advantage (broadcast over its tokens), or [N, T] per token
    verifier_failures: dict[str, int]  # verifier name -> items it raised on or returned None for
    verifier_errors: dict[str, str] = field(default_factory=dict)  # verifier name -> first error text (if any)
    verifier_errored: dict[str, int] = field(default_factory=dict)  # verifier name -> items it raised on / scored badly
    # the aggregation's own `reward/...` figures; reward/code_exec/suspicious with code_exec among the verifiers
    reward_metrics: dict[str, float] = field(default_factory=dict)
    ensemble_report: dict | None = None  # on steps the label-free ensemble was refit: its report


@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's k most likely next tokens at every completion position (`distill.topk`), at the sampling
    temperature: the update adds `weight` times the student's KL to them (`forge.losses.TOPK_DIVERGENCES`)."""

    ids: torch.Tensor  # [N, T, k] token ids
    logp: torch.Tensor  # [N, T, k] the teacher's log-probs of them
    weight: float  # distill.weight
    divergence: str = "reverse"  # distill.divergence: forge.losses.TOPK_DIVERGENCES

    def kl(self, student_logp: torch.Tensor) -> torch.Tensor:
        """[n, T] `weight` times the KL (`divergence`) between the student's log-probs of these tokens, [n, T, k], and
        the teacher's (`forge.losses.TOPK_DIVERGENCES`)."""
        from forge.losses import TOPK_DIVERGENCES

        return self.weight * TOPK_DIVERGENCES[self.divergence](student_logp, self.logp)

    def rows(self, rows: slice, width: int, device) -> TeacherTopK:
        """Rows `rows`, cut to a micro-batch's `width` tokens, on `device`."""
        ids, logp = self.ids[rows, :width].to(device), self.logp[rows, :width].to(device)
        return TeacherTopK(ids, logp, self.weight, self.divergence)


@dataclass(frozen=True)
class UpdateStats:
    """What one update step did (means over micro-batches and PPO passes)."""

    loss: float
    kl_old: float  # approximate KL to pi_old, the policy at the start of the update (0 with one PPO pass)
    clip_frac_low: float
    clip_frac_high: float
    entropy: float
    grad_norm: float  # pre-clip global norm (mean over optimizer steps)
    lr: float  # LR actually used (schedule x adaptive scale)
    lr_scale: float  # adaptive controller multiplier
    tokens: int  # completion tokens trained on
    seconds: float
    policy_version: int  # version after this update
    sync_seconds: float = 0.0  # new weights -> rollout model: rank 0 publishes, the pipeline loads (0 in-process)
    logprob_diff: float = 0.0  # mean |log pi_old - log mu| over the step's tokens: trainer vs sampler mismatch
    logprob_gaps: tuple[tuple[float, ...], ...] = ()  # per token log pi_old - log mu of the step's first rows (at
    # most SAMPLES_PER_STEP, those on this rank) over each row's real tokens (0 off its sampled ones): the token view
    is_truncated_frac: float = 0.0  # tis: share of tokens whose importance weight hit algo.is_cap
    skipped: int = 0  # optimizer steps (PPO passes) skipped because the loss or gradient norm was not finite
    kl_ref: float = 0.0  # k3 KL to the reference policy (algo.beta > 0; 0 otherwise)
    teacher_kl: float | None = None  # distill.topk: the weighted top-k KL per token, before the first pass (None
    # without a top k)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of an update, on the trainer's device. n rows, T completion tokens (shared padding cut)."""

    prompt_ids: torch.Tensor  # [n, P] left-padded
    prompt_mask: torch.Tensor  # [n, P]
    completion_ids: torch.Tensor  # [n, T]
    completion_mask: torch.Tensor  # [n, T] 1 on every real token after the prompt (attended)
    advantages: torch.Tensor  # [n], or [n, T] per token
    sampler_logp: torch.Tensor  # [n, T] log-probs under the policy that sampled (mu)
    old_logp: torch.Tensor | None = None  # [n, T] pi_old, fixed before the first of several PPO passes
    ref_logp: torch.Tensor | None = None  # [n, T] the reference policy's (algo.beta > 0)
    loss_mask: torch.Tensor | None = None  # [n, T] 1 on the tokens the loss counts (sampled); None = completion_mask
    teacher: TeacherTopK | None = None  # [n, T, k] the teacher's top k (distill.topk > 0)
    episode_tokens: torch.Tensor | None = None  # [n] loss tokens of each row's whole episode, where an episode is
    # several sequences (forge.sequences); None = each row is its episode

    @property
    def train_mask(self) -> torch.Tensor:
        """[n, T] the tokens the loss, the importance weights, entropy, KL and log-prob diff count."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask


@dataclass(frozen=True)
class MicroStats:
    """Sums over one micro-batch's completion tokens (the trainer adds them up over micro-batches and ranks)."""

    loss: float  # the micro-batch's share of the step loss
    kl_old: float
    kl_ref: float
    clip_low: float
    clip_high: float
    entropy: float
    logprob_diff: float  # |log pi_old - log mu|: trainer vs sampler
    is_truncated: float  # tokens whose importance weight hit algo.is_cap
    teacher_kl: float = 0.0  # the weighted top-k KL to the teacher (distill.topk)
    gap: torch.Tensor | None = field(default=None, compare=False)  # [n, T] log pi_old - log mu on the train mask (0
    # elsewhere), detached: not a sum, the trainer keeps the first rows' for the token record

    @classmethod
    def of(cls, res: LossOutput, entropy, old, mb: MicroBatch, weight, cap: float, distill=None) -> MicroStats:
        m = mb.train_mask.bool()
        gap = torch.where(m, old - mb.sampler_logp, 0.0).detach()  # [n, T]; 0 off the train mask, whatever is there
        return cls(
            loss=float(res.loss.detach()),
            kl_old=float(res.kl_old[m].sum()),
            kl_ref=float(res.kl_ref[m].sum()) if res.kl_ref is not None else 0.0,
            clip_low=float(res.clipped_low.sum()),
            clip_high=float(res.clipped_high.sum()),
            entropy=float(entropy[m].sum()),
            logprob_diff=float(gap.abs()[m].sum()),
            is_truncated=float((weight[m] >= cap).sum()) if weight is not None else 0.0,
            teacher_kl=float(distill.detach()[m].sum()) if distill is not None else 0.0,
            gap=gap,
        )
