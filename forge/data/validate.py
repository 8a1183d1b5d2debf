"""Checking rows, purely: which rows are valid (`validate_rows`), one type per column (`check_column_types`), and
the data.on_bad_rows policy with its one-line error (`validated`).

A prompt is a non-empty string or a non-empty list of `{"role", "content"}` chat messages (roles system, user,
assistant); a reference answer a non-empty string or a finite number. Good rows become {"id", "prompt", "answer",
**other columns}; each rejected row is recorded with its 1-based number and the reason, naming the column.

Columns keep their types: a column whose rows hold values of different types (an int in one row, a string in
another) is a one-line error naming the column and two row numbers; ints and floats mixed in one column are stored
as floats. The answer column is also kept as `answer` (as text, what the built-in verifiers compare), and under its
own name, with its own type, when `data.answer_column` names another column.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge.data.config import DataConfig
from forge.errors import UserError

BASE_COLUMNS = ["id", "prompt", "model_input", "answer"]
"""The columns every prepared row starts with; the source's other columns follow, sorted."""
_ROLES = ("system", "user", "assistant")
_MAX_REJECTED_IN_ERROR = 5


def validate_rows(
    rows: list[dict],
    *,
    source: str,
    prompt_column: str,
    answer_column: str | None,
    count_tokens: Callable[[str | list[dict]], int],
    max_prompt_tokens: int,
) -> tuple[list[dict], list[int], list[dict]]:
    """Split rows into (good, their 1-based row numbers, rejected). Pure.

    rejected items are {"row": 1-based row number, "reason": ...}, reasons naming the column: "missing field
    'answer'", "prompt is not a string or a list of messages (got int)", "empty prompt", "prompt message 2 has
    role 'tool'; use system, user or assistant", "answer is not a string or number (got list)", "empty answer",
    "prompt has 300 tokens > data.max_prompt_tokens=256", "duplicate id 'x' (first at row 2)".
    count_tokens gets the raw prompt; pass a function that applies the chat template and tokenizes.
    Good rows become {"id", "prompt", "answer", **other columns as stored}: id is the row's "id" column (as
    text), else "<source stem>-<row>"; the answer is text (numbers str()-ed), and also kept as stored under
    its own name when answer_column is not "answer"; other columns named id/prompt/answer/model_input are dropped.
    answer_column None reads unlabeled rows: no answer is checked and every row's answer is None.
    """
    good, numbers, rejected, first_row_of_id = [], [], [], {}
    stem = re.sub(r"[*?\[\]]", "", Path(source.rstrip("/")).stem) or "row"
    for n, row in enumerate(rows, 1):
        reason = _row_problem(row, prompt_column, answer_column, count_tokens, max_prompt_tokens)
        row_id = _row_id(row, stem, n)
        if reason is None and row_id in first_row_of_id:
            reason = f"duplicate id {row_id!r} (first at row {first_row_of_id[row_id]})"
        if reason is not None:
            rejected.append({"row": n, "reason": reason})
            continue
        first_row_of_id[row_id] = n
        good.append(_normalise(row, row_id, prompt_column, answer_column))
        numbers.append(n)
    return good, numbers, rejected


def _row_problem(
    row: dict,
    prompt_column: str,
    answer_column: str | None,
    count_tokens: Callable[[str | list[dict]], int],
    max_prompt_tokens: int,
) -> str | None:
    """Why this row is invalid, or None. Cheap checks first; tokens are counted last."""
    for column in (prompt_column, answer_column):
        if column is not None and row.get(column) is None:
            return f"missing field '{column}'"
    prompt = row[prompt_column]
    why = _prompt_problem(prompt, prompt_column)
    if why is None and answer_column is not None:
        why = _answer_problem(row[answer_column], answer_column)
    if why is not None:
        return why
    n_tokens = count_tokens(prompt)
    if n_tokens > max_prompt_tokens:
        return f"{prompt_column} has {n_tokens} tokens > data.max_prompt_tokens={max_prompt_tokens}"
    return None


def _answer_problem(answer: Any, column: str) -> str | None:
    """Why a reference answer is not a non-empty string or finite number, or None."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"{column} is not a string or number (got {type(answer).__name__})"
    if isinstance(answer, float) and math.isinf(answer):
        return f"{column} is not a finite number (got {answer})"
    if isinstance(answer, str) and "\x00" in answer:
        return f"{column} contains a NUL byte (a binary or mis-encoded file?)"
    if not _answer_text(answer).strip():
        return f"empty {column}"
    return None


def _prompt_problem(prompt: Any, column: str) -> str | None:
    """Why a prompt is neither a non-empty string nor a list of {role, content} chat messages, or None."""
    if isinstance(prompt, str):
        if "\x00" in prompt:
            return f"{column} contains a NUL byte (a binary or mis-encoded file?)"
        return None if prompt.strip() else f"empty {column}"
    if not isinstance(prompt, list):
        return f"{column} is not a string or a list of messages (got {type(prompt).__name__})"
    if not prompt:
        return f"empty {column} (no messages)"
    for i, message in enumerate(prompt, 1):
        if not isinstance(message, dict):
            return f"{column} message {i} is not a {{role, content}} object (got {type(message).__name__})"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in _ROLES:
            return f"{column} message {i} has role {role!r}; use system, user or assistant"
        if not isinstance(content, str):
            return f"{column} message {i} content is not a string (got {type(content).__name__})"
        if "\x00" in content:
            return f"{column} message {i} contains a NUL byte (a binary or mis-encoded file?)"
    if not any(m["content"].strip() for m in prompt):
        return f"empty {column} (every message is blank)"
    return None


def _answer_text(answer: str | int | float) -> str:
    if isinstance(answer, float) and math.isnan(answer):  # a null in a pandas-written float column
        return ""
    return str(answer)


def _to_str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:  # dates and other parquet types
        return str(value)


def _row_id(row: dict, stem: str, n: int) -> str:
    given = _to_str(row.get("id"))
    return given if given.strip() else f"{stem}-{n}"


def _normalise(row: dict, row_id: str, prompt_column: str, answer_column: str | None) -> dict:
    skip = {prompt_column, answer_column, *BASE_COLUMNS}
    extras = {str(k): v for k, v in row.items() if k not in skip}
    if answer_column is None:  # unlabeled: no reference answer
        return {"id": row_id, "prompt": row[prompt_column], "answer": None, **extras}
    if answer_column != "answer":  # verifiers written for the source (TRL's `solution`) read it by its own name
        extras[answer_column] = row[answer_column]
    return {"id": row_id, "prompt": row[prompt_column], "answer": _answer_text(row[answer_column]), **extras}


def validated(
    rows: list[dict],
    source: str,
    prompt_column: str,
    answer_column: str | None,
    dc: DataConfig,
    count_tokens: Callable[[str | list[dict]], int],
) -> tuple[list[dict], list[dict]]:
    """validate_rows (answer_column None: unlabeled rows) plus the data.on_bad_rows policy and the
    one-type-per-column check; rejected items get a "file" key."""
    good, numbers, rejected = validate_rows(
        rows,
        source=source,
        prompt_column=prompt_column,
        answer_column=answer_column,
        count_tokens=count_tokens,
        max_prompt_tokens=dc.max_prompt_tokens,
    )
    if rejected and (dc.on_bad_rows == "error" or not good):
        raise UserError(_bad_rows_message(source, rejected, all_bad=not good))
    check_column_types(good, numbers, source)
    return good, [{"file": source, **r} for r in rejected]


def _bad_rows_message(source: str, rejected: list[dict], all_bad: bool) -> str:
    shown = "; ".join(f"row {r['row']}: {r['reason']}" for r in rejected[:_MAX_REJECTED_IN_ERROR])
    more = "; ..." if len(rejected) > _MAX_REJECTED_IN_ERROR else ""
    noun = "row" if len(rejected) == 1 else "rows"
    fix = "fix them" if all_bad else "fix them or set data.on_bad_rows=skip"
    every = "all " if all_bad else ""
    return f"{source}: {every}{len(rejected)} invalid {noun} ({shown}{more}); {fix}"


def check_column_types(rows: list[dict], numbers: list[int], source: str) -> None:
    """Every column holds one Arrow type across the rows (ints and floats together become floats); else a
    UserError naming the column and two row numbers (`numbers[i]` is row i's number in the source). Pure."""
    for column in dict.fromkeys(k for r in rows for k in r):
        present = [(n, r[column]) for r, n in zip(rows, numbers, strict=True) if r.get(column) is not None]
        if present and arrow_type([v for _, v in present]) is None:
            (first, a), (other, b) = present[0], _first_clash(present)
            raise UserError(
                f"{source}: column '{column}' mixes types (row {first}: {type_label(a)}, row {other}: "
                f"{type_label(b)}); make every row's value the same type"
            )


def arrow_type(values: list) -> Any:
    """The Arrow type pyarrow infers for these values, or None when they do not fit one type."""
    import pyarrow as pa

    try:
        return pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError):
        return None


def _first_clash(present: list[tuple[int, Any]]) -> tuple[int, Any]:
    """The first (row, value) that cannot share a type with the first present value."""
    head = present[0][1]
    for n, v in present[1:]:
        if arrow_type([head, v]) is None:
            return n, v
    return present[-1]  # only the set as a whole clashes (e.g. nested lists): name the last row


def type_label(value: Any) -> str:
    if isinstance(value, list) and value:
        return f"list of {type(value[0]).__name__}"
    return type(value).__name__
