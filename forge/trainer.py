"""The update stage around the recipe's math: Accelerate-wrapped AdamW over micro-batches, `num_iterations` PPO
passes per batch, one optimizer step per pass. The math of one micro-batch (log-probs -> ratio -> loss ->
backward) is the recipe's (`forge.recipes.grpo.update_micro_batch`, handed in as `micro_update`); this module
keeps micro-batching, gradient sync over ranks, clipping, the non-finite skip and the optimizer.

Each micro-batch's loss is already normalised by the step's global counts
(`forge.losses.StepTotals`), so gradients are summed, never averaged, across micro-batches: the result does
not depend on the micro-batch size. Under data parallelism (persistent rank processes, `forge.workers.TrainerWorker`,
forming one torch.distributed group) every rank reads the whole batch, computes the step's global counts from it, and trains on
its own contiguous share of the rows; DDP (and FSDP's reduce-scatter) average gradients over ranks, so each rank
scales its loss by the world size to keep the same global sum. The reported loss, KL, clip fractions and entropy
are summed over ranks, so they, too, do not depend on the split.

Precision: bf16 autocast on GPUs, fp32 on CPU (`update.autocast_bf16` opts a CPU run into bf16 autocast where the
CPU has bf16 units; `forge.precision`); the reference model runs under the same autocast as the policy, so the KL
at identical weights is exactly 0. Log-probs never hold a [n, T, vocab] fp32 tensor (`chunked_logprobs`).
A micro-batch is packed into one padding-free row in which each group's prompt appears once (GRPO's G completions
of a prompt share it), where that costs fewer FLOPs (`update.shared_prefix`, `forge.shared_prefix`): same
log-probs up to float rounding.
FSDP (`update.strategy=fsdp`, more than one rank) shards the model with torch's `fully_shard` (FSDP2) per decoder
layer and at the root, because Accelerate 1.15's FSDP plugin is silently ignored on CPU (it wraps the model in
DDP). Only rank 0 reads the weights; every rank allocates only its shards (`fsdp.shard_from_rank0`), and the
reference model (algo.beta > 0) is sharded the same way. Checkpoints are sharded (`forge.distributed.state`,
`forge.checkpoint`): each rank saves its own slice and a checkpoint loads into any strategy and number of ranks.

Log-probs are computed with explicit position ids from the attention mask (prompts are left-padded, as in
`generate`), with logits divided by the sampling temperature, and log-softmax taken in fp32 even under bf16
autocast. With one PPO pass the "old" log-probs are the current ones detached, so the ratio is exactly 1.
The sampler's own log-probs (`Rollouts.sampling_logprobs`) are compared with them on every step
(`train/logprob_diff`) and, with `algo.is_correction=tis`, weight the loss (`forge.losses.importance_weights`).
Dropout (a LoRA adapter's) draws from a seed derived from (seed, step, rank), so a resumed run draws the same.

Multi-turn episodes (`Rollouts.loss_mask` differs from `completion_mask`): the forward, its padding and the
shared-prefix packing follow `completion_mask` (every real token, one contiguous run per row, so packing needs no
fallback), and only the loss, its token counts and the reported figures follow the loss mask (`MicroBatch.loss_mask`).
Single-turn micro-batches carry no loss mask and run exactly the code they ran before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.checkpoint import checkpoint

from forge.advantages import advantage_mass, advantage_rows
from forge.checkpoint import has_weights, load_adapter, load_weights, read_shards, read_weights
from forge.distributed import fsdp
from forge.distributed import state as dist_state
from forge.errors import UserError
from forge.losses import StepTotals
from forge.lr import AdaptiveLR, scheduled_lr
from forge.models import adapter_tensors, is_peft, merged_shapes, merged_tensors, merged_weights
from forge.precision import update_bf16
from forge.records import SAMPLES_PER_STEP, MicroBatch, MicroStats, Rollouts, TeacherTopK, UpdateStats
from forge.sequences import TrainingRows, training_rows
from forge.shared_prefix import (
    PackingCost,
    completion_lengths,
    group_spans,
    pack,
    pack_saves_compute,
    packed_length,
    packed_logits,
)
from forge.trainer_config import AlgoConfig, UpdateConfig


def _loss_mask(ro: Rollouts, rows: slice, width: int, device) -> torch.Tensor | None:
    """The micro-batch's loss mask [n, width], or None where it equals the completion mask (single-turn): the
    single-turn update then runs exactly the code it ran before loss masks existed."""
    if ro.single_turn:
        return None
    return ro.loss_mask[rows, :width].to(device)


@dataclass(frozen=True)
class TokenLogprobs:
    logp: torch.Tensor  # [n, T] log-prob of each completion token
    entropy: torch.Tensor  # [n, T] entropy of the predictive distribution (detached)
    extra: torch.Tensor | None = None  # [n, T, k] log-probs of the `extra_ids` asked for (the teacher's top k)


# fp32 elements of one chunk of [n, t, vocab] log-softmax (256 MiB): bounds the log-prob temporaries at any length
LOGPROB_CHUNK_ELEMENTS = 2**26
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # torch's fused AdamW (CPU and CUDA)
MICRO_SUMS = tuple(f.name for f in dataclasses.fields(MicroStats) if f.name != "gap")  # gap: per token, not a sum
# (current log-probs of a micro-batch, the micro-batch, algo config, step totals, backward) -> its sums
MicroUpdate = Callable[..., MicroStats]


def token_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    temperature: float = 1.0,
    autocast_bf16: bool = False,
    completion_only: bool = True,
    chunk_elements: int = LOGPROB_CHUNK_ELEMENTS,
    packing: PackingCost | None = None,
    extra_ids: torch.Tensor | None = None,
) -> TokenLogprobs:
    """Per-token log-probs of `completion_ids` given the left-padded prompts. Shapes [n, P] and [n, T].

    The model's logits stay in its compute dtype; the fp32 log-softmax is taken over chunks of completion positions
    (`chunk_elements` fp32 values each), recomputed in the backward pass when there are several, so no
    [n, T, vocab] fp32 tensor is ever held: per row the values are those of one full log-softmax. With `packing`
    (the model's cost model), the rows are packed into one padding-free row in which each group's prompt is
    computed once (`forge.shared_prefix`) where that costs fewer FLOPs. `extra_ids` [n, T, k]: also the log-probs of
    those tokens at each completion position (`TokenLogprobs.extra`)."""
    n, T = completion_ids.shape
    if packing is not None and completion_only and packing.fits(prompt_ids.shape[1] + T):
        spans = group_spans(prompt_ids, prompt_mask)
        length = packed_length(prompt_mask, completion_lengths(completion_mask), spans)
        if (
            pack_saves_compute(packing, n, prompt_ids.shape[1] + T, length)
            and (packed := pack(prompt_ids, prompt_mask, completion_ids, completion_mask, spans)) is not None
        ):
            dtype = next(model.parameters()).dtype
            with autocast_context(prompt_ids.device.type, autocast_bf16):
                logits = packed_logits(model, packed, packing.mask_kind, dtype)  # [1, C, vocab]
            extra = None if extra_ids is None else extra_ids[packed.taken][None]  # [1, C, k]
            flat = chunked_logprobs(logits, packed.targets, temperature, chunk_elements, extra)  # [1, C]
            return TokenLogprobs(
                logp=flat.logp.new_zeros(n, T).masked_scatter(packed.taken, flat.logp[0]),
                entropy=flat.entropy.new_zeros(n, T).masked_scatter(packed.taken, flat.entropy[0]),
                extra=None if extra is None else unpack_rows(flat.extra[0], packed.taken),
            )
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, autocast_bf16,
                               completion_only)  # fmt: skip
    return chunked_logprobs(logits, completion_ids, temperature, chunk_elements, extra_ids)


def completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, autocast_bf16: bool = False,
                      completion_only: bool = True) -> torch.Tensor:  # fmt: skip
    """[n, T, vocab] the model's logits at every completion position (position t predicts token t), in its compute
    dtype, over the left-padded prompts and right-padded completions."""
    T = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, P+T]
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention.long().cumsum(dim=1) - 1).clamp(min=0)
    kwargs = {"logits_to_keep": T + 1} if completion_only else {}
    with autocast_context(input_ids.device.type, autocast_bf16):
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, **kwargs).logits
    return logits[:, -(T + 1) : -1]


@torch.no_grad()
def chunked_scores(logits, ids, temperature: float = 1.0, k: int = 0, tokens: int | None = None,
                   chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A frozen scorer's view of sampled tokens, one log_softmax(logits / temperature) per chunk of positions (no
    [n, T, vocab] fp32 tensor held, no entropy): the log-prob at `ids` [n, T]; with k > 0 also the k largest
    log-probs among the first `tokens` ids (a tokenizer's; the output layer may have padding rows past it) and those
    ids. [n, T, V] -> [n, T] (, [n, T, k], [n, T, k])."""
    n, T, vocab = logits.shape
    step = max(1, chunk_elements // max(1, n * vocab))
    parts, values, top_ids = [], [], []
    for t in range(0, T, step):
        logsm = torch.log_softmax(logits[:, t : t + step].float() / temperature, dim=-1)
        parts.append(logsm.gather(-1, ids[:, t : t + step].unsqueeze(-1)).squeeze(-1))
        if k:
            top = logsm[..., :tokens].topk(k, dim=-1)
            values.append(top.values)
            top_ids.append(top.indices)
    logp = torch.cat(parts, dim=1)
    return (logp, torch.cat(values, dim=1), torch.cat(top_ids, dim=1)) if k else (logp,)


def unpack_rows(flat: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """[C, k] values of the packed positions back to [n, T, k] (0 where `taken` [n, T] is False)."""
    out = flat.new_zeros(*taken.shape, flat.shape[-1])
    out[taken] = flat
    return out


def update_seed(seed: int, step: int, rank: int) -> int:
    """The seed of update `step`'s draws on rank `rank` (a LoRA adapter's dropout), derived from the run seed: a
    resumed or recovered run draws what the uninterrupted one did, with no RNG state to carry.

    >>> update_seed(0, 1, 0) == update_seed(0, 1, 0) != update_seed(0, 2, 0)
    True
    """
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0]) & 0x7FFFFFFF


def autocast_context(device_type: str, bf16: bool):
    """bf16 autocast on `device_type` if `bf16`, else nothing: the one place the update and rollout pick it."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def chunked_logprobs(logits, ids, temperature: float = 1.0, chunk_elements: int = LOGPROB_CHUNK_ELEMENTS,
                     extra_ids: torch.Tensor | None = None) -> TokenLogprobs:  # fmt: skip
    """log_softmax(logits / temperature) at `ids` and the entropy, over chunks of positions. [n, T, V], [n, T]; and
    at `extra_ids` [n, T, k] when given."""
    n, T, vocab = logits.shape
    step = max(1, chunk_elements // max(1, n * vocab))
    # one chunk is kept for backward like any activation; several are recomputed there, or all would be kept
    recompute = T > step and torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for t in range(0, T, step):
        chunk, chunk_ids = logits[:, t : t + step], ids[:, t : t + step]
        extra = None if extra_ids is None else extra_ids[:, t : t + step]
        if recompute:
            parts.append(checkpoint(_chunk_logprobs, chunk, chunk_ids, temperature, extra, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(chunk, chunk_ids, temperature, extra))
    logp, entropy, extra = (_join(list(p)) for p in zip(*parts, strict=True))
    return TokenLogprobs(logp=logp, entropy=entropy, extra=extra)


def _join(chunks: list) -> torch.Tensor | None:
    """The chunks' [n, t, ...] tensors along positions (one chunk as it is; None when none was asked for)."""
    return None if chunks[0] is None else chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)


def _chunk_logprobs(chunk, ids, temperature: float, extra_ids=None) -> tuple[torch.Tensor, ...]:
    logsm = torch.log_softmax(chunk.float() / temperature, dim=-1)  # [n, t, vocab] fp32
    logp = logsm.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    extra = None if extra_ids is None else logsm.gather(-1, extra_ids)  # [n, t, k]
    with torch.no_grad():
        entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy, extra


def make_accelerator(timeout: timedelta | None = None) -> Accelerator:
    """The update's Accelerator (gloo on CPU when several processes, NCCL on GPUs); `timeout` bounds every
    collective of a multi-process group. No `mixed_precision`: the trainer applies autocast itself
    (`forge.precision`), to the policy and the reference model alike, and leaves the module's forward unpatched."""
    cuda = torch.cuda.is_available()
    handlers = [InitProcessGroupKwargs(timeout=timeout)] if timeout is not None else []
    return Accelerator(cpu=not cuda, mixed_precision="no", kwargs_handlers=handlers)


class Trainer:
    """Owns the policy's optimisation: optimizer, LR schedule + adaptive scale, policy version."""

    def __init__(self, model, update: UpdateConfig, algo: AlgoConfig, total_steps: int, *, seed: int = 0,
                 temperature: float = 1.0, max_new_tokens: int = 16, ref_model=None,
                 accelerator: Accelerator | None = None, micro_update: MicroUpdate | None = None):  # fmt: skip
        """`micro_update`: the update math of one micro-batch (`forge.recipes.grpo.update_micro_batch`); the
        trainer around it micro-batches, syncs gradients, clips and steps. `temperature` and `max_new_tokens`: the
        rollout's (log-probs at the sampling temperature; the loss's length normaliser); `seed`: the run's."""
        assert micro_update is not None, "the trainer needs the recipe's micro-batch update (micro_update=...)"
        self.micro_update = micro_update
        self.update_cfg, self.algo, self.seed = update, algo, seed
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.total_steps = total_steps
        self.accelerator = accelerator or make_accelerator()
        u = update
        self.fsdp = u.strategy == "fsdp" and self.accelerator.num_processes > 1
        device_type = self.accelerator.device.type
        self.autocast_bf16 = update_bf16(u.autocast_bf16, device_type)
        # FSDP: bf16 compute with fp32 reduction on GPUs, as autocast does without FSDP; the reference alike
        shard = functools.partial(fsdp.shard_from_rank0, device=self.accelerator.device,
                                  bf16=self.autocast_bf16 and device_type == "cuda")  # fmt: skip
        if self.fsdp:
            model = shard(model)
        if self.fsdp and is_peft(model):
            raise UserError("model.lora.rank > 0 cannot be combined with update.strategy=fsdp: use ddp")
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter only
        # fused: one kernel over all parameters (0.12 s vs 0.41 s per step for 133M fp32 parameters on 2 CPU
        # cores); FSDP's sharded DTensor parameters take the default implementation
        fused = not self.fsdp and all(p.dtype in FUSED_DTYPES for p in trainable)
        optimizer = torch.optim.AdamW(
            trainable, lr=u.lr, betas=tuple(u.adam_betas), weight_decay=u.weight_decay, fused=fused or None
        )
        if self.fsdp:
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if ref_model is not None and self.fsdp:  # sharded like the policy, and loaded from rank 0 alike
            ref_model = shard(ref_model).requires_grad_(False)
        elif ref_model is not None:
            ref_model = ref_model.to(self.accelerator.device)
        # LoRA: the reference is the base model, i.e. the policy with its adapter disabled (no second copy)
        assert algo.beta == 0 or ref_model is not None or is_peft(model), "algo.beta > 0 needs a reference model"
        self.ref_model = ref_model
        self.packing = PackingCost.of(self.unwrapped) if u.shared_prefix else None
        self.adaptive = AdaptiveLR(u.adaptive)
        self.step = 0
        self.policy_version = 0

    @property
    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    def current_lr(self) -> float:
        base = scheduled_lr(self.update_cfg, self.step, self.total_steps)
        return base * (self.adaptive.scale if self.update_cfg.adaptive.enabled else 1.0)

    def update(self, rollouts: Rollouts, advantages: torch.Tensor, teacher: TeacherTopK | None = None) -> UpdateStats:
        """One update on this rank's share of the step's rows: `update.num_iterations` passes of the micro-batches
        through `micro_update` (the recipe's math), one optimizer step each; the rows are the episodes', then the
        further sequences of agent episodes that are several (`forge.sequences`). `advantages`: [N], or [N, T] per token;
        `teacher`: the teacher's top k at every position, whose KL the loss adds (distill.topk)."""
        start, lr = time.perf_counter(), self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(update_seed(self.seed, self.step + 1, self.accelerator.process_index))
        rows = training_rows(rollouts, advantages)  # an agent episode's further sequences join as rows
        my_rows = self._my_rows(rows.rollouts.num_completions)
        micro = self._micro_batches(rows, my_rows, teacher)
        totals = StepTotals(sequences=rows.episodes, tokens=int(rows.rollouts.loss_mask.sum()),
                            max_len=self.max_new_tokens)  # fmt: skip
        passes = [self._one_pass(micro, totals) for _ in range(self.update_cfg.num_iterations)]
        mean = lambda k: sum(p[k] for p in passes) / len(passes)  # noqa: E731
        skipped = sum(p["skipped"] for p in passes)
        kl_ref, kl_old = passes[-1]["kl_ref"], passes[-1]["kl_old"]
        # the adaptive LR's kl signal: to the reference when there is one, else to pi_old (forge/lr.py)
        signal_kl = kl_ref if self.algo.beta > 0 else kl_old
        observe = self.update_cfg.adaptive.enabled and not skipped  # a NaN would poison the controller's average
        mass = advantage_mass(advantages, rollouts.loss_mask)  # the whole step's, the same on every rank
        scale = self.adaptive.observe(signal_kl, mean("grad_norm"), mass) if observe else self.adaptive.scale
        self.step += 1
        self.policy_version += 1
        return UpdateStats(
            loss=mean("loss"), kl_old=kl_old, kl_ref=kl_ref, clip_frac_low=mean("clip_low"),
            clip_frac_high=mean("clip_high"), entropy=passes[0]["entropy"], logprob_diff=passes[0]["logprob_diff"],
            logprob_gaps=self._first_rows_gaps(micro, passes[0]["gaps"], first_row=my_rows.start),
            is_truncated_frac=passes[0]["is_truncated"], grad_norm=mean("grad_norm"),
            teacher_kl=None if teacher is None else passes[0]["teacher_kl"],
            lr=lr, lr_scale=scale,
            tokens=totals.tokens, seconds=time.perf_counter() - start, policy_version=self.policy_version,
            skipped=skipped,
        )  # fmt: skip

    def _my_rows(self, n: int) -> range:
        """This rank's contiguous share of the batch's n rows (the first n % world ranks get one more)."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        assert n >= world, f"a batch of {n} completions cannot feed {world} update processes"
        size, extra = divmod(n, world)
        start = rank * size + min(rank, extra)
        return range(start, start + size + (rank < extra))

    @staticmethod
    def _first_rows_gaps(micro: list[MicroBatch], gaps: list, first_row: int) -> tuple[tuple[float, ...], ...]:
        """Per token log pi_old - log mu of the step's first SAMPLES_PER_STEP rows, each over its real tokens: what
        samples.jsonl's token record shows beside the sampling log-prob. Only the rank whose rows begin the step
        (`first_row` 0; rank 0, whose stats are the step's) keeps them; also empty where the micro-update gave none."""
        out: list[tuple[float, ...]] = []
        if first_row != 0:
            return ()
        for mb, gap in zip(micro, gaps, strict=True):
            take = min(SAMPLES_PER_STEP - len(out), mb.completion_ids.shape[0])
            if gap is None or take <= 0:
                break
            lengths = mb.completion_mask[:take].sum(1).tolist()  # right-padded: the real tokens come first
            rows = gap[:take].float().cpu().tolist()  # one copy to the host per micro-batch
            out += [tuple(round(x, 4) for x in row[:k]) for row, k in zip(rows, lengths, strict=True)]
        return tuple(out)

    def _micro_batches(self, step: TrainingRows, rows: range, teacher: TeacherTopK | None = None) -> list[MicroBatch]:
        """The rank's rows in micro-batches of update.micro_batch_size, with pi_old's log-probs when several PPO
        passes need them fixed and the reference's when algo.beta > 0."""
        ro, advantages, episode_tokens = step.rollouts, step.advantages, step.episode_tokens
        size, device, out = self.update_cfg.micro_batch_size, self.accelerator.device, []
        for i in range(rows.start, rows.stop, size):
            sl = slice(i, min(i + size, rows.stop))
            width = max(1, int(ro.completion_mask[sl].sum(1).max()))  # right padding the whole micro-batch shares
            adv = advantage_rows(advantages, sl, width).to(device)  # [n], or [n, width] per token
            mb = MicroBatch(ro.prompt_ids[sl].to(device), ro.prompt_mask[sl].to(device),
                            ro.completion_ids[sl, :width].to(device), ro.completion_mask[sl, :width].to(device),
                            adv, ro.sampling_logprobs[sl, :width].to(device),
                            loss_mask=_loss_mask(ro, sl, width, device),
                            teacher=None if teacher is None else teacher.rows(sl, width, device),
                            episode_tokens=None if episode_tokens is None else episode_tokens[sl].to(device))  # fmt: skip
            old = self._fixed_logprobs(mb, self.model) if self.update_cfg.num_iterations > 1 else None
            ref = self._reference_logprobs(mb) if self.algo.beta > 0 else None
            out.append(dataclasses.replace(mb, old_logp=old, ref_logp=ref))
        return out

    def _logprobs(self, model, mb: MicroBatch, teacher_tokens: bool = True) -> TokenLogprobs:
        """The model's log-probs of the micro-batch's tokens (and of the teacher's top k when it has them)."""
        # attention covers every real token (mb.completion_mask); the loss mask only selects what is trained
        return token_logprobs(
            model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
            temperature=self.temperature, autocast_bf16=self.autocast_bf16,
            completion_only=self.update_cfg.logits_completion_only, packing=self.packing,
            extra_ids=mb.teacher.ids if teacher_tokens and mb.teacher is not None else None,
        )  # fmt: skip

    @torch.no_grad()
    def _fixed_logprobs(self, mb: MicroBatch, model) -> torch.Tensor:
        return self._logprobs(model, mb, teacher_tokens=False).logp

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """The reference policy's log-probs: its own model, or (LoRA) the policy under peft's `disable_adapter`."""
        if self.ref_model is not None:
            return self._fixed_logprobs(mb, self.ref_model)
        with self.unwrapped.disable_adapter():
            return self._fixed_logprobs(mb, self.unwrapped)

    def _one_pass(self, micro: list[MicroBatch], totals: StepTotals) -> dict:
        """One optimizer step over the micro-batches: gradients summed (reduced over ranks with the last one)."""
        self.optimizer.zero_grad(set_to_none=True)
        world, algo = self.accelerator.num_processes, self.algo
        backward = lambda loss: self.accelerator.backward(loss * world)  # noqa: E731  DDP averages over ranks
        policy = functools.partial(self._logprobs, self.model)
        acc, gaps = dict.fromkeys(MICRO_SUMS, 0.0), []
        for i, mb in enumerate(micro):
            with self._grad_sync(i == len(micro) - 1):
                counts = dataclasses.replace(totals, row_tokens=mb.episode_tokens)  # None: each row its episode
                stats = self.micro_update(policy, mb, algo, counts, backward=backward)
            for k in acc:
                acc[k] += getattr(stats, k)
            gaps.append(stats.gap)
        acc = self._sum_over_ranks(acc)  # before the step: every rank decides on the same global loss
        grad_norm, stepped = self._clip_and_step(acc["loss"])
        tokens = max(totals.tokens, 1)
        return {"loss": acc["loss"], "grad_norm": grad_norm, "skipped": int(not stepped), "gaps": gaps,
                **{k: acc[k] / tokens for k in MICRO_SUMS if k != "loss"}}  # fmt: skip

    def _grad_sync(self, last: bool):
        """Reduce gradients over ranks only with the step's last micro-batch. FSDP2 modules have their own switch
        (`accelerator.no_sync` does nothing for them: every micro-batch would be reduce-scattered)."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def _sum_over_ranks(self, acc: dict[str, float]) -> dict[str, float]:
        if self.accelerator.num_processes == 1:
            return acc
        values = torch.tensor(list(acc.values()), dtype=torch.float64, device=self.accelerator.device)
        return dict(zip(acc, self.accelerator.reduce(values, reduction="sum").tolist(), strict=True))

    def _clip_and_step(self, loss: float) -> tuple[float, bool]:
        """Clip to update.max_grad_norm (0 = no clipping: an infinite bound only measures the norm); step, unless
        the (global) loss or gradient norm is not finite: then the gradients are dropped and the weights and AdamW
        moments stay as they were. Returns (pre-clip norm, whether the optimizer stepped)."""
        max_norm = self.update_cfg.max_grad_norm if self.update_cfg.max_grad_norm > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = self.accelerator.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not (math.isfinite(norm) and math.isfinite(loss)):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        self.optimizer.step()
        return norm, True

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full state dict on CPU, on rank 0 at least (under FSDP a collective: every rank must call it)."""
        if self.fsdp:
            return fsdp.full_model_state(self.model)
        if is_peft(self.unwrapped):  # LoRA: W + scale * B @ A under the base model's names, the module untouched
            return merged_weights(self.unwrapped)
        return {k: v.detach().cpu() for k, v in self.unwrapped.state_dict().items()}

    def publish_shapes(self, adapter: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, full shape) of what `publish_tensors(adapter)` yields, in its order; no collective, no copy,
        nothing computed."""
        model = self.unwrapped
        if is_peft(model) and adapter:
            return [(k, v.dtype, tuple(v.shape)) for k, v in adapter_tensors(model)]
        if is_peft(model):
            return merged_shapes(model, tied=False)
        unique = dist_state.unique_names(model)
        return [(k, v.dtype, tuple(v.shape)) for k, v in model.state_dict().items() if k in unique]

    def publish_tensors(self, adapter: bool = False):
        """(name, tensor) of the full weights without tied copies, where they live (the trainer's device), one at a
        time: what the weight group sends. Under FSDP each parameter is gathered in turn (`full_tensor`, a collective:
        every rank must iterate it to the end). LoRA: with `adapter`, the adapter's tensors alone (`adapter_tensors`:
        for a receiver that holds the base and an adapter of the same config); else the merged weights, each
        computed on the device only when the weight group packs it (`merged_tensors`), never the merged model at
        once."""
        model = self.unwrapped
        if is_peft(model):
            yield from adapter_tensors(model) if adapter else merged_tensors(model, tied=False)
            return
        unique = dist_state.unique_names(model)
        for k, v in model.state_dict().items():
            if k in unique:
                yield k, (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()

    def checkpoint_tensors(self, with_model: bool) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's tensors for a sharded checkpoint (`forge.distributed.state`: the weights if `with_model`,
        AdamW's moments; live, DTensor shards under FSDP) and the rest as plain values: the optimizer's param
        groups, the adaptive LR state, step and policy version."""
        flat, groups = dist_state.trainer_tensors(self.unwrapped, self.optimizer, with_model)
        self._forget_init_step()
        plain = {"param_groups": groups, "adaptive": self.adaptive.state_dict(), "step": self.step,
                 "policy_version": self.policy_version}  # fmt: skip
        return flat, plain

    def restore(self, ckpt: Path, plain: dict) -> None:
        """Resume from checkpoint directory `ckpt` (a collective with several ranks): the weights from its HF file
        (in place) or its shards, the optimizer from its shards, resharded to this rank layout by DCP; then the
        plain values `checkpoint_tensors` gave (the `trainer` entry of `forge.checkpoint.load_state`)."""
        lora = is_peft(self.unwrapped)
        in_shards = not lora and not has_weights(ckpt)
        if lora:
            load_adapter(self.unwrapped, ckpt)
        elif not in_shards and self.fsdp:
            fsdp.load_full_model_state(self.model, read_weights(ckpt))
        elif not in_shards:
            load_weights(self.unwrapped, ckpt)
        targets, _ = dist_state.trainer_tensors(self.unwrapped, self.optimizer, with_model=in_shards)
        read_shards(ckpt, targets)
        dist_state.load_trainer_tensors(self.unwrapped, self.optimizer, targets, plain["param_groups"])
        for group in self.optimizer.param_groups:  # this run's settings, not the saved ones: a resume may change them
            group["betas"], group["weight_decay"] = tuple(self.update_cfg.adam_betas), self.update_cfg.weight_decay
        self.adaptive.load_state_dict(plain["adaptive"])
        self.step = plain["step"]
        self.policy_version = plain["policy_version"]
        self._forget_init_step()

    def _forget_init_step(self) -> None:
        """Before the first update (a step-0 checkpoint), drop the AdamW state torch made with its zero-LR
        initialising step (`forge.distributed.state.trainer_tensors`): kept, that step would count in AdamW's bias
        correction and shrink the first real update. The saved tensors stay valid (the snapshot holds them)."""
        if self.step == 0:
            self.optimizer.state.clear()
