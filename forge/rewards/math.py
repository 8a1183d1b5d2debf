r"""Final-answer checking for math-style tasks: a fast path for plain numbers, math-verify for everything else.

`completion_matches(completion, ref)` is what the `math_answer` verifier scores with:

1. Fast path (today's checker, unchanged): when the reference is a plain number (42, -7, 3.14, 1,234, 3/4, 2.5e3,
   also "x = 5" or "30^\circ") and `extract_answer` pulls a plain number out of the completion, the verdict is
   `answers_match` on the two: equal within 1e-6 relative. A plain-number reference and a completion holding no
   digit at all is no match. No sympy, no math-verify, no child process: integer tasks (smollm2-arith) score
   exactly as before, at the same speed.
2. Otherwise Hugging Face's math-verify decides (forge/rewards/mathverify.py: `parse` + `verify` in a child
   process with a hard time and memory bound). The reference is parsed as LaTeX, wrapped in `$...$` unless it
   already has math delimiters or `\boxed`; the prediction is the whole completion (math-verify finds the final
   answer: "final answer is", `\boxed{}`, the last LaTeX or plain expression), or the last `<answer>...</answer>`
   when there is one. math-verify handles fractions, percents (10\% matches 10 and 0.1), intervals, sets,
   tuples (ordered), matrices, units and degrees, equations (x = 5 matches 5) and thousands separators.
3. A reference that is only words ("Monday", "yes", "\text{east}") also matches when `answers_match` finds the
   extracted answer (or a completion of at most 3 words) equal as case-insensitive text: math-verify reads a word
   as a product of single-letter symbols and finds no final answer in "The answer is Monday."

`extract_answer` pulls one final answer out of a completion, trying in order: "final answer is X" when it comes
after the last `\boxed{}`, the last balanced `\boxed{...}` (or `\fbox{...}`), the last `<answer>...</answer>`,
the last "answer is X" / "Answer: X", then the last number in the text, read with the LaTeX it belongs to: the
`$...$` / `$$...$$` / `\(...\)` / `\[...\]` math it sits in, else the LaTeX touching it (`\frac{10}{9}` is not
9, `$-[0,1)$` not 1); an answer that is an equation states its last side that is a plain number ("555 + 363 = 1108"
states 1108). With a plain-number reference, arithmetic left unevaluated ("555 + 363", "x = 555 + 363": the
question restated) never matches: math-verify would evaluate it, and GRPO learnt "The final answer is a + b =
anything" from that (3-digit sums, 4 PPO passes per step: held-out pass@1 1.0 in 16 steps, before this rule).
`answers_match` compares a prediction with a reference: numerically when both are plain numbers, symbolically with
sympy when both are short, safe expressions, otherwise as normalised strings.

On Math-Verify's own test cases (tests/fixtures/mathverify_suite.jsonl, 264 run) `completion_matches` agrees with
the expected verdict on 256 (0.970; math-verify as called here: 0.989). It departs on purpose where the fast path
reads numbers its own way: "(9+1)" is unevaluated arithmetic, not 10; a decimal comma ("1000,99", "2,74") or a
space between thousands ("1 000") is not read as one number; "AZYUK2A" holds the number 2; and math spanning lines
(`$ \n 9 \n $`) still counts, which only their LaTeX-only extraction target refuses.

Numbers are bounded: a number with an exponent beyond 400 or over 400 characters is compared as text (building
it exactly could take hours). Sympy has no timeout here, so the symbolic path only runs on strings under 100 characters made of digits,
operators, parentheses, single-letter variables and a few named functions, with no stacked or 3-digit powers, no
exponent notation and no 30-digit literals:
`parse_expr` evaluates its input with `eval`, and completions are model output. Simple LaTeX (`\frac`, `\sqrt`,
`\cdot`, `^`) is rewritten first and implicit multiplication is allowed, so `2\sqrt{2}` matches `sqrt(8)`.
"""

from __future__ import annotations

import cmath
import re
from fractions import Fraction

from forge.rewards.mathverify import math_verify_match

# A number as people write it: 42, -7, 3.14, 1,234 (thousands), 3/4. The sign is only taken when the minus
# does not follow a word or a closing bracket, so "5-3" yields 5 and 3, not 5 and -3.
NUMBER_PATTERN = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?!\d)")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\b\s*:?|:)[ \t]*([^\n]+)", re.IGNORECASE)
_FINAL_ANSWER_IS = re.compile(r"\bfinal\s+answer\s+is\b", re.IGNORECASE)
# math delimiters: an unescaped $ or $$ (one delimiter), and what touches a number that is part of LaTeX
_DOLLAR = re.compile(r"(?<!\\)\$\$?")
_GLUED_BEFORE = re.compile(r"(?:[{^_]|\\[A-Za-z]+)\s*\Z")
_GLUED_AFTER = re.compile(r"\s*[}^_]")
_LATEX_MARK = re.compile(r"[$\\{}^_]")  # a text without any of these holds no LaTeX around its numbers
_GLUE_WINDOW = 40  # characters before a number searched for a brace or command touching it
_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")  # "0,111" is no thousands number
_LATEX_NOISE = [
    (re.compile(r"\\text\s*\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\\mathrm\s*\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\^\s*\{?\\circ\}?"), ""),
    (re.compile(r"\\left|\\right|\\[!,;: ]|\\?\$"), ""),
    (re.compile(r"^\s*[A-Za-z]\w*\s*=\s*"), ""),  # "x = 5" -> "5"
]
_LATEX_TO_SYMPY = [
    (re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"(\1)/(\2)"),
    (re.compile(r"\\sqrt\s*\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\(pi|sin|cos|tan|log|exp)\b"), r"\1"),
]
_SAFE_CHARS = re.compile(r"[A-Za-z0-9\s+\-*/().]*")
_SAFE_NAMES = {"sqrt", "pi", "sin", "cos", "tan", "log", "exp"}
_RISKY_POWER = re.compile(r"\*\*\s*\(?\s*-?\s*\d{3,}|\*\*[^+\-*/]*\*\*")
_REL_TOL = 1e-6
# Fraction("1e999999999") computes 10**999999999 (hours, in C: no signal can stop it): numbers with a larger
# exponent or more digits than these are compared as text, never built
_MAX_EXPONENT = 400
_MAX_NUMBER_CHARS = 400
_EXPONENT = re.compile(r"[eE]([+-]?\d+)")
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
_WORDS = re.compile(r"[A-Za-z][A-Za-z' -]*")
_EQUALS = re.compile(r"(?<![<>!=])=(?!=)")  # an equation's "=", not part of <=, >=, != or ==
# unevaluated arithmetic ("555 + 363", "(2+3)*4", "6 \times 7"): only these characters, and an operator between two
# digits; two linear scans (one pattern with nested quantifiers took minutes on a 100,000-digit answer)
_LATEX_OPERATORS = re.compile(r"\\(?:times|cdot|div)")
_ARITHMETIC_CHARS = re.compile(r"[\d\s.,()+\-*/^×÷]+")
_ARITHMETIC_OPERATOR = re.compile(r"\d[\s)]*[-+*/^×÷][\s(]*\d")
_SHORT_WORDS = 3


def completion_matches(completion: str, ref: str) -> bool:
    r"""Whether the completion's final answer equals the reference `ref` (see the module docstring for the rules).

    >>> completion_matches("The answer is 57.", "57"), completion_matches("5 7", "57")
    (True, False)
    >>> completion_matches(r"so $x = \boxed{\dfrac{1}{2}}$", r"\frac12"), completion_matches(r"\boxed{[1,2]}", "[1,2)")
    (True, False)
    >>> completion_matches("Yes.", "yes"), completion_matches("The answer is Monday.", r"\text{Tuesday}")
    (True, False)
    """
    pred = extract_answer(completion)
    y = _as_number(_normalise(ref))
    if y is not None:  # the first branch of answers_match, without normalising twice
        x = None if pred is None else _as_number(_normalise(pred))
        if x is not None:
            return _numbers_close(x, y)
        if not re.search(r"\d", completion) or _unevaluated(_EQUALS.split(pred or "")[-1]):
            return False  # no number; or arithmetic left unevaluated, such as the question restated ("x = 555 + 363")
    if math_verify_match(_gold_text(ref), _prediction_text(completion)):
        return True
    if pred is None and len(completion.split()) <= _SHORT_WORDS:
        pred = completion
    return bool(_WORDS.fullmatch(_normalise(ref))) and answers_match(pred, ref)


def _unevaluated(answer: str) -> bool:
    r"""Whether `answer` is numbers joined by arithmetic operators and nothing else.

    >>> _unevaluated("555 + 363"), _unevaluated(r"6 \times 7"), _unevaluated("-5"), _unevaluated("x + 1")
    (True, True, False, False)
    """
    s = _LATEX_OPERATORS.sub("*", answer)
    return bool(_ARITHMETIC_CHARS.fullmatch(s) and _ARITHMETIC_OPERATOR.search(s))


def is_plain_number(s: str) -> bool:
    r"""Whether the fast path reads `s` as a number (after `answers_match`'s normalisation).

    >>> is_plain_number("1,234"), is_plain_number("x = -3/4"), is_plain_number(r"\frac{3}{4}"), is_plain_number("10\\%")
    (True, True, False, False)
    """
    return _as_number(_normalise(s)) is not None


def answer_key(text: str) -> str | None:
    r"""What a completion's final answer is compared by when answers vote (`reward.aggregate=majority`): the
    `extract_answer` answer after the normalisation the fast path uses, as the exact number it spells when it is
    a plain number (so 1,234, 1234 and 1234.0 agree), else as lower-case text without spaces; None = no answer.

    >>> answer_key("The answer is 1,234."), answer_key(r"\boxed{1234.0}"), answer_key("x = 3/6")
    ('1234', '1234', '1/2')
    >>> answer_key(r"\boxed{\text{East}}"), answer_key("no idea") is None
    ('east', True)
    """
    pred = extract_answer(text)
    if pred is None:
        return None
    s = _normalise(pred)
    x = _as_number(s)
    return str(x) if x is not None else _squash(s)


def _gold_text(ref: str) -> str:
    return ref if any(d in ref for d in _MATH_DELIMITERS) else f"${ref}$"


def _prediction_text(completion: str) -> str:
    tagged = _last_tagged(completion)
    if tagged is None or not tagged.strip():
        return completion
    return _gold_text(tagged.strip())


def extract_answer(text: str) -> str | None:
    r"""The final answer in `text`, or None when there is none. Commas are dropped from a bare last number.

    >>> extract_answer(r"so \boxed{\frac{1}{2}} and not \boxed{3}... wait: \boxed{\frac{3}{4}}.")
    '\\frac{3}{4}'
    >>> extract_answer("<answer> 12 </answer>"), extract_answer("The answer is 42."), extract_answer("2+3=5")
    ('12', '42', '5')
    >>> extract_answer("The final answer is 555 + 363 = 1108."), extract_answer("The answer is 555 + 363.")
    ('1108', '555 + 363')
    >>> extract_answer("I have no idea") is None
    True
    """
    for find in (_final_answer_after_boxed, _last_boxed, _last_tagged, _answer_is, _last_number):
        if (found := find(text)) is not None and (cleaned := _clean(found)):
            return _stated_side(cleaned)
    return None


def _stated_side(answer: str) -> str:
    """What an answer that is an equation states: its last side that is a plain number ("555 + 363 = 1108" states
    1108, not the 918 its left side evaluates to); the answer unchanged when no side is one.

    >>> _stated_side("555 + 363 = 1108"), _stated_side("918 = 900 + 18"), _stated_side("x <= 5")
    ('1108', '918', 'x <= 5')
    """
    sides = _EQUALS.split(answer)
    for side in reversed(sides if len(sides) > 1 else []):
        if _as_number(_normalise(side)) is not None:
            return _clean(side)
    return answer


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[m.end() : i]
    return None  # none, or every one was cut off before its closing brace


def _last_tagged(text: str) -> str | None:
    found = _TAGGED.findall(text)
    return found[-1] if found else None


def _answer_is(text: str) -> str | None:
    found = _ANSWER_IS.findall(text)
    if not found:
        return None
    sentence = _clean(re.split(r"(?<=\S)\.\s", found[-1], maxsplit=1)[0])
    m = NUMBER_PATTERN.match(sentence)
    if m and re.fullmatch(r"(\s+[A-Za-z].*)?", sentence[m.end() :], re.DOTALL):  # "42" or "42 apples"
        return m.group().replace(",", "")
    return sentence


def _final_answer_after_boxed(text: str) -> str | None:
    r"""What "final answer is" states when it comes after the last `\boxed{}` (a model that boxed a step, then
    concluded in words), else None: the later statement wins, as in math-verify.

    >>> _final_answer_after_boxed(r"so \boxed{255} more. The final answer is $10,455$. I hope it is correct.")
    '10455'
    >>> _final_answer_after_boxed(r"The final answer is $\boxed{5}$.") is None
    True
    """
    last_box = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    finals = list(_FINAL_ANSWER_IS.finditer(text, last_box)) if last_box >= 0 else []
    return _answer_is(text[finals[-1].start() :]) if finals else None


def _last_number(text: str) -> str | None:
    r"""The last number in `text`, commas dropped; or, when that number is part of LaTeX, the LaTeX around it: the
    inline or display math it sits in (`$...$`, `$$...$$`, `\(...\)`, `\[...\]`), else the run of non-space
    characters when braces, `^`, `_` or a command touch it (`\frac{10}{9}` is not 9).

    >>> _last_number("It is 1,234 apples"), _last_number(r"so $x = \frac13$ here"), _last_number(r"\frac{10}{9}")
    ('1234', 'x = \\frac13', '\\frac{10}{9}')
    >>> _last_number("I have no idea") is None
    True
    """
    if not _LATEX_MARK.search(text):  # plain text (the arithmetic tasks): the number as it stands
        found = NUMBER_PATTERN.findall(text)
        return found[-1].replace(",", "") if found else None
    *_, m = (None, *NUMBER_PATTERN.finditer(text))
    if m is None:
        return None
    span = _math_around(text, m.start(), m.end())
    if span is not None:
        return span
    if _GLUED_BEFORE.search(text, max(0, m.start() - _GLUE_WINDOW), m.start()) or _GLUED_AFTER.match(text, m.end()):
        return text[_run_start(text, m.start()) : _run_end(text, m.end())]
    return m.group().replace(",", "")


def _math_around(text: str, start: int, end: int) -> str | None:
    r"""The content of the LaTeX math that text[start:end] lies in, or None when it lies in none.

    >>> _math_around("a $1 + 2$ b", 3, 4), _math_around(r"a \( 7 \) b", 5, 6), _math_around("a $1$ 2", 6, 7) is None
    ('1 + 2', ' 7 ', True)
    """
    before, after = text[:start], text[end:]
    dollars = list(_DOLLAR.finditer(before))
    if len(dollars) % 2 and (close := _DOLLAR.search(after)):
        return text[dollars[-1].end() : end + close.start()]
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        i = before.rfind(opener)
        if i >= 0 and i > before.rfind(closer) and (j := after.find(closer)) >= 0:
            return text[i + len(opener) : end + j]
    return None


def _run_start(text: str, i: int) -> int:
    while i > 0 and not text[i - 1].isspace():
        i -= 1
    return i


def _run_end(text: str, i: int) -> int:
    while i < len(text) and not text[i].isspace():
        i += 1
    return i


def _clean(s: str) -> str:
    prev = None
    while s != prev:
        prev, s = s, s.strip().strip("$").rstrip(".,;:!?").strip()
    return s


def answers_match(pred: str | None, ref: str) -> bool:
    r"""Whether a predicted answer equals the reference: numbers within 1e-6 relative, else sympy, else text.

    >>> answers_match("1,234", "1234"), answers_match("0.75", "3/4"), answers_match(r"\frac{3}{4}", "0.75")
    (True, True, True)
    >>> answers_match("2*(x+1)", "2*x+2"), answers_match("-5", "5"), answers_match(None, "5")
    (True, False, False)
    """
    if pred is None:
        return False
    a, b = _normalise(pred), _normalise(str(ref))
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return _numbers_close(x, y)
    if _symbolic_equal(a, b):
        return True
    return _squash(a) == _squash(b)


def _normalise(s: str) -> str:
    s = _clean(s)
    for pattern, repl in _LATEX_NOISE:
        s = pattern.sub(repl, s)
    return _clean(s)


def _as_number(s: str) -> Fraction | None:
    """The number `s` spells, or None; bounded: see _MAX_EXPONENT.

    >>> _as_number("1e999999999") is None, _as_number("2.5e3")
    (True, Fraction(2500, 1))
    """
    s = s.replace(" ", "")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if len(s) > _MAX_NUMBER_CHARS or any(abs(int(e)) > _MAX_EXPONENT for e in _EXPONENT.findall(s)):
        return None
    try:
        return Fraction(s)  # ints, decimals, "3/4", "1e-6"
    except (ValueError, ZeroDivisionError):
        return None


def _numbers_close(x: Fraction | complex, y: Fraction | complex) -> bool:
    if x == y:
        return True
    try:
        return cmath.isclose(complex(x), complex(y), rel_tol=_REL_TOL)
    except (OverflowError, TypeError):
        return False


def _symbolic_equal(a: str, b: str) -> bool:
    ea, eb = _to_sympy(a), _to_sympy(b)
    if ea is None or eb is None:
        return False
    try:
        if ea.is_number and eb.is_number:
            return _numbers_close(complex(ea), complex(eb))
        import sympy

        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # sympy raises many kinds of errors on odd input; a failed check is just "no match"
        return False


def _to_sympy(s: str):  # -> sympy.Expr | None (sympy imported lazily: it is slow to import)
    for pattern, repl in _LATEX_TO_SYMPY:
        prev = None
        while s != prev:  # innermost \frac first, until none are left
            prev, s = s, pattern.sub(repl, s)
    s = s.replace("^", "**").replace("{", "(").replace("}", ")")
    if not _is_safe_expression(s):
        return None
    try:
        from sympy.parsing import sympy_parser as sp

        expr = sp.parse_expr(s, transformations=(*sp.standard_transformations, sp.implicit_multiplication_application))
        return expr if hasattr(expr, "is_number") else None
    except Exception:  # parse_expr raises SyntaxError, TypeError, TokenError, ... on text that is not math
        return None


def _is_safe_expression(s: str) -> bool:
    if not s.strip() or len(s) >= 100 or not _SAFE_CHARS.fullmatch(s) or _RISKY_POWER.search(s):
        return False
    if re.search(r"\.\s*[A-Za-z]", s):  # attribute access
        return False
    if re.search(r"\d[eE]|\d{30}", s):  # sympy builds 1e999999999 or a 10**k literal exactly: unbounded time
        return False
    return all(len(name) == 1 or name in _SAFE_NAMES for name in re.findall(r"[A-Za-z]+", s))


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s).lower()
