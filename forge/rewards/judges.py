"""Model-based weak verifiers from local directories: a reward model and an LLM judge.

- `RewardModel(path)`: a Hugging Face sequence-classification model; score = sigmoid(logit) with one label,
  else the softmax probability of the last label ("good").
- `LLMJudge(path)`: a causal LM asked whether the answer is correct; score = P(yes) / (P(yes) + P(no)) from
  its next-token distribution (first token of " yes"/"yes" and " no"/"no"). Batched: identical (prompt,
  completion) pairs are judged once (a converging policy repeats itself), questions are batched by length (little
  padding), and only the last position's logits are computed (`logits_to_keep=1`: no [n, T, vocab] tensor).
Both are used in `reward.verifiers` as `reward_model=PATH` / `llm_judge=PATH`, PATH a local model directory or a
built-in model name (`llm_judge=smollm2-135m-instruct`: the demo policy's own frozen initial weights as judge);
they never see reference answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from forge.errors import UserError

JUDGE_QUESTION = "Question: {prompt}\nProposed answer: {completion}\nIs the proposed answer correct? Reply yes or no."


def _load_tokenizer(path: str, what: str):
    """(checked directory, tokenizer with a pad token) for a local model directory or a built-in model name."""
    from transformers import AutoTokenizer

    from forge.models import SMOLLM2, check_model_dir, smollm2_dir

    p = smollm2_dir() if path == SMOLLM2 else Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise UserError(f"{what} '{path}' is not a local Hugging Face model directory (no config.json)")
    check_model_dir(p, f"replace it with a whole copy, or point the {what} verifier at another model directory")
    tok = AutoTokenizer.from_pretrained(p)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return p, tok


class RewardModel:
    forgeweave_takes_text = True  # forge.rewards.verifiers.takes_text: scores prompt + completion text

    def __init__(self, path: str, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification

        p, self.tok = _load_tokenizer(path, "reward_model")
        self.model = AutoModelForSequenceClassification.from_pretrained(p).eval()
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
        out: list[float | None] = []
        for i in range(0, len(prompts), self.batch_size):
            texts = [
                p + c
                for p, c in zip(prompts[i : i + self.batch_size], completions[i : i + self.batch_size], strict=True)
            ]
            enc = self.tok(texts, return_tensors="pt", padding=True, truncation=True)
            logits = self.model(**enc).logits.float()  # [n, labels]
            probs = torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else torch.softmax(logits, -1)[:, -1]
            out.extend(probs.tolist())
        return out


class LLMJudge:
    forgeweave_takes_text = True  # forge.rewards.verifiers.takes_text: asks about prompt and completion text

    def __init__(self, path: str, batch_size: int = 16):
        from transformers import AutoModelForCausalLM

        p, self.tok = _load_tokenizer(path, "llm_judge")
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(p).eval()
        yes, no = self._first_ids(["yes", " yes", "Yes", " Yes"]), self._first_ids(["no", " no", "No", " No"])
        self.yes, self.no = sorted(set(yes) - set(no)), sorted(set(no) - set(yes))  # a shared first token says nothing
        self.batch_size = batch_size

    def _first_ids(self, words: list[str]) -> list[int]:
        return sorted({self.tok(w, add_special_tokens=False).input_ids[0] for w in words})

    def _question(self, prompt: str, completion: str) -> str:
        text = JUDGE_QUESTION.format(prompt=prompt.strip(), completion=completion.strip())
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text + "\nAnswer:"

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
        pairs = list(zip(prompts, completions, strict=True))
        unique = list(dict.fromkeys(pairs))  # each distinct (prompt, completion) once, in first-seen order
        questions = [self._question(p, c) for p, c in unique]
        ids = [self.tok(q, add_special_tokens=False).input_ids for q in questions]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
        p_yes = [0.0] * len(unique)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            enc = self.tok.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt")
            logits = self.model(**enc, logits_to_keep=1).logits[:, -1].float()  # [n, vocab]
            probs = torch.softmax(logits, dim=-1)
            yes, no = probs[:, self.yes].sum(-1), probs[:, self.no].sum(-1)
            for i, value in zip(batch, (yes / (yes + no).clamp(min=1e-12)).tolist(), strict=True):
                p_yes[i] = value
        score = dict(zip(unique, p_yes, strict=True))
        return [score[pair] for pair in pairs]


FACTORIES = {"reward_model": RewardModel, "llm_judge": LLMJudge}
