r"""Grading a final answer against a reference: answer extraction, then numeric or exact match.

Contract of :func:`grade_answer(response, expected)` (the default grader of :class:`~agentenv.envs.tool_env.ToolEnv`):

1. The predicted answer is extracted from the response by :func:`extract_answer`:
   a. the content of the LAST ``\boxed{...}`` (nested braces handled, e.g. ``\boxed{\frac{1}{2}}``), else
   b. if the reference is a number: the LAST number in the response ("last-number fallback"; so
      "3 * 4 = 12" answers 12, and a response that ends with a different number is graded on that number), else
   c. the text after the last "answer is" / "answer:", else the whole response.
2. If both prediction and reference parse as numbers (integers with or without thousands separators, decimals,
   scientific notation, ``a/b`` and ``\frac{a}{b}``): an integer reference must be matched exactly, however large
   (``12``, ``12.0``, ``1.2e1`` match 12; ``12.0000001`` does not); any other reference matches when
   ``|p - e| <= max(abs_tol, rel_tol * |e|)``. Values that are not finite (``1e999``, ``1e200/1e-200``) are not
   numbers; grading never raises on any response text.
3. Otherwise they match when equal after :func:`normalize` (case, surrounding whitespace/``$``/final period,
   ``\text{}`` wrappers and inner whitespace runs are ignored).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?"
_NUM_RE = re.compile(rf"(?<![\w.])(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) with balanced braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: the model was cut off inside the box


def last_number(text: str) -> str | None:
    found = _NUM_RE.findall(text)
    return found[-1] if found else None


def parse_number(text: str) -> Fraction | float | None:
    """A number written as int / decimal / scientific / ``a/b`` / ``\\frac{a}{b}``, else None. Exact where possible."""
    s = normalize(text)
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", s)
    s = s.replace("(", "").replace(")", "").replace(" ", "")
    if not s:
        return None
    if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+)(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if "/" in s:
            if s.count("/") > 1:  # a/b/c is no number we grade (and splitting it recursively could go 1,000 deep)
                return None
            a, b = s.split("/", 1)
            num, den = parse_number(a), parse_number(b)
            if num is None or den is None or den == 0:
                return None
            if isinstance(num, Fraction) and isinstance(den, Fraction):
                return num / den
            value = float(num) / float(den)  # 1e200/1e-200 is inf, not an error: no number then
            return value if math.isfinite(value) else None
        if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
            return Fraction(s)  # exact: big integers and decimals compare without float rounding
        value = float(s)
        return value if math.isfinite(value) else None
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def normalize(text: str) -> str:
    s = text.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.strip().strip("$").strip()
    s = s.rstrip(".").strip()
    return re.sub(r"\s+", " ", s).lower()


def extract_answer(response: str, expected: str | None = None) -> str:
    """The answer a response commits to (see the module docstring for the order of rules)."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    if expected is not None and parse_number(expected) is not None:
        num = last_number(response)
        if num is not None:
            return num
    m = list(re.finditer(r"answer(?:\s+is)?\s*[:=]?\s*", response, re.IGNORECASE))
    return response[m[-1].end():].strip() if m else response.strip()


def numbers_match(pred: str, expected: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool | None:
    """True / False when both parse as numbers; None when either does not."""
    p, e = parse_number(pred), parse_number(expected)
    if p is None or e is None:
        return None
    if isinstance(e, Fraction) and e.denominator == 1:
        # An integer reference needs the exact value: a tolerance would accept 1.2345678e20 for a 21-digit product.
        return Fraction(p) == e
    return abs(float(p) - float(e)) <= max(abs_tol, rel_tol * abs(float(e)))


def grade_answer(response: str, expected: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    pred = extract_answer(response, expected)
    num = numbers_match(pred, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    return num if num is not None else normalize(pred) == normalize(expected)
