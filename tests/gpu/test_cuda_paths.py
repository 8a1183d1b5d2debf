"""The GPU paths on a real CUDA device (skipped without one: tests/conftest.py; run by scripts/gpu_check.sh).

Plain functions without fixtures, so scripts/gpu_check.py can also run them where pytest is not installed.
"""

from __future__ import annotations

import copy

import torch

from forge.models import build_char_tokenizer, build_tiny_model
from forge.rollout import HFBackend, SamplingParams
from forge.trainer import chunked_logprobs
from tests.grpo_parts import Trainer

PROMPTS = ["1+2=", "33+4=", "5+5="]


def _tiny(hidden: int = 64, layers: int = 2):
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(tok, hidden=hidden, layers=layers, seed=0)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def _batch(tok):
    from tests.test_trainer import make_batch

    return make_batch(tok)


def test_update_on_cuda_runs_bf16_autocast_with_fp32_masters_and_zero_reference_kl():
    from tests.test_trainer import make_cfg

    model, tok = _tiny()
    cfg = make_cfg(micro_batch_size=4)
    cfg.algo.beta = 0.1
    trainer = Trainer(model, cfg, total_steps=2, ref_model=copy.deepcopy(model).eval().requires_grad_(False))
    assert trainer.accelerator.device.type == "cuda" and trainer.autocast_bf16
    assert {p.dtype for p in trainer.unwrapped.parameters()} == {torch.float32}
    stats = trainer.update(*_batch(tok))
    assert stats.kl_ref == 0.0 and torch.isfinite(torch.tensor(stats.loss))


def _lm_head_dtypes(model, backend) -> set:
    seen = set()
    hook = model.lm_head.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    try:
        backend.generate(PROMPTS, SamplingParams(max_new_tokens=3, n=1, seed=0))
    finally:
        hook.remove()
    return seen


def test_rollout_autocast_flag_is_honoured_on_a_module_the_trainer_holds():
    from tests.test_trainer import make_cfg

    model, tok = _tiny()
    Trainer(model, make_cfg(), total_steps=1)  # the in-process layout: the rollout samples from the trainer's module
    assert _lm_head_dtypes(model, HFBackend(model, tok, autocast_bf16=False)) == {torch.float32}
    assert _lm_head_dtypes(model, HFBackend(model, tok, autocast_bf16=True)) == {torch.bfloat16}


def test_chunked_logprobs_on_cuda_equal_the_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 33, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 1000, (4, 33), device="cuda")
    out = chunked_logprobs(logits, ids, 0.7, chunk_elements=4 * 1000 * 5)
    full = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logp, full)
    g_chunked = torch.autograd.grad(out.logp.sum(), logits)[0]
    g_full = torch.autograd.grad(full.sum(), logits)[0]
    torch.testing.assert_close(g_chunked, g_full)


def test_hf_rollout_on_cuda_samples_on_the_device():
    model, tok = _tiny()
    model = model.cuda()
    ro = HFBackend(model, tok).generate(PROMPTS, SamplingParams(max_new_tokens=4, n=2, seed=1))
    assert ro.num_completions == 6 and (ro.sampling_logprobs[ro.completion_mask.bool()] < 0).all()


def test_ipc_weight_group_on_one_gpu_is_bit_exact():
    """Colocated mode's transport on the GPU (forge/weight_group.py, backend ipc): rank 0 packs bf16 buckets on
    cuda:0 and shares them by CUDA IPC handle; a spawned receiver process on the same GPU maps them, clones, and
    must hold the sender's cast bit for bit over two syncs; the buckets are freed after the acks."""
    import tempfile
    from pathlib import Path

    from forge.weight_group import plan_for
    from tests.test_weight_group import HOST, _host, _start, expected, weights

    with tempfile.TemporaryDirectory() as out:
        plan = plan_for(weights(0).items(), torch.bfloat16, bucket_bytes=1024)
        group, port = _host(2, backend="ipc")
        assert group.device.type == "cuda"
        procs = _start(2, port, plan, 2, Path(out), "ipc")
        group.connect(HOST, port, local_address=HOST)
        before = torch.cuda.memory_allocated()
        for step in range(2):
            group.send(plan, ((k, v.cuda()) for k, v in weights(step).items()))
        procs[0].join(timeout=120)
        assert procs[0].exitcode == 0
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= before  # no bucket outlived its sync
        group.close()
        for step in range(2):
            got = torch.load(Path(out) / f"rank1-step{step}.pt", map_location="cpu")
            want = expected(step, torch.bfloat16)
            assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want), step
