"""Build the TRL-style example: a conversational `prompt` column and an integer `target` column, saved with
`datasets.save_to_disk` as a DatasetDict (train: every single-digit sum up to 9, test: the same 55 problems,
since the point of the tiny task is mastering it), and optionally a tiny random chat model to train on CPU.

    python examples/trl_style/build_dataset.py --out data/arith-chat [--tiny-model models/tiny-chat]
"""

import argparse
from pathlib import Path

from datasets import Dataset, DatasetDict

# the tiny character-level model's chat template: the messages' text as is (so "3+4=" is what it reads)
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def sums() -> list[dict]:
    """Every a + b <= 9 with single digits: 55 problems, as chat messages with an integer target."""
    return [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "target": a + b}
        for a in range(10)
        for b in range(10)
        if a + b <= 9
    ]


def build(out: Path) -> DatasetDict:
    rows = sums()
    data = DatasetDict(train=Dataset.from_list(rows), test=Dataset.from_list(rows))
    data.save_to_disk(str(out))
    return data


def tiny_chat_model(out: Path, seed: int = 0) -> None:
    """forgeweave's tiny random Llama (as in the tiny preset) with a chat template, saved as an HF directory."""
    from forge.models import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    model = build_tiny_model(tok, hidden=128, layers=2, seed=seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the DatasetDict")
    p.add_argument("--tiny-model", help="also write the tiny chat model here")
    args = p.parse_args()
    print(build(Path(args.out)))
    if args.tiny_model:
        tiny_chat_model(Path(args.tiny_model))
        print(f"tiny chat model: {args.tiny_model}")
