"""Run in the vLLM venv (no pytest there): a fresh engine that loads a model directory's weights from disk, greedy
over some prompts. The reference for tests/flows/test_vllm_weight_group.py."""

from __future__ import annotations

import torch

from forge.rollout.vllm import engine_kwargs


def disk_greedy(cfg, model_dir: str, prompts: list[str], tokens: int) -> list[list[int]]:
    """Greedy completion token ids (eos included) of an engine built from `model_dir`'s weights (fp32, as the
    engine under test) with the run's engine arguments, weights read from disk instead of dummy."""
    from transformers import AutoTokenizer
    from vllm import LLM, TokensPrompt
    from vllm import SamplingParams as VSampling

    kwargs = engine_kwargs(cfg.rollout, model_dir, torch.float32, seed=0, cuda=False)
    kwargs.update(load_format="auto", worker_extension_cls="")
    llm, tok = LLM(**kwargs), AutoTokenizer.from_pretrained(model_dir)
    requests = [TokensPrompt(prompt_token_ids=tok(p, add_special_tokens=False).input_ids) for p in prompts]
    params = VSampling(temperature=0, max_tokens=tokens, stop_token_ids=[tok.eos_token_id], top_k=0)
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]


def track_receive_buffers(worker) -> None:
    """Inside a vLLM worker: from now on, as each (name, tensor) pair of a sync reaches vLLM's loader, count the weight
    group's receive buffers alive and the bytes of the pairs' tensors that are still alive (kept by the loader), and
    keep the largest of each on the worker."""
    import gc
    import weakref

    from forge.weight_group import WeightGroup

    group, live, given = worker.forgeweave_group, [], []
    make, stream = WeightGroup._empty_bucket, group.stream
    worker.forgeweave_live_max = worker.forgeweave_kept_max = 0

    def tracked(plan, index):
        buffer = make(group, plan, index)
        live.append(weakref.ref(buffer))
        return buffer

    def counted(plan):
        for name, tensor in stream(plan):
            given.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
            gc.collect()
            worker.forgeweave_live_max = max(worker.forgeweave_live_max, sum(r() is not None for r in live))
            kept = sum(n for r, n in given if r() is not None)
            worker.forgeweave_kept_max = max(worker.forgeweave_kept_max, kept)
            yield name, tensor
            del tensor

    group._empty_bucket, group.stream = tracked, counted


def live_receive_buffers(worker) -> tuple[int, int]:
    """The most receive buffers alive at once since `track_receive_buffers`, and the most bytes of the sync's tensors
    alive at once (the one in hand included)."""
    return worker.forgeweave_live_max, worker.forgeweave_kept_max


