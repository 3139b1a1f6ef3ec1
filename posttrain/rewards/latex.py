"""Math answers read by a small LaTeX reader of our own, for the `math_equal` checker
(posttrain/rewards/checkers.py): no math-verify, no latex2sympy, no `eval`. `math_normal_form`
drops what does not change the value (`$`, spacing, `\\text{}` units, degrees, percent signs, a
leading `x =`, thousands separators); `LatexReader` turns the rest into a sympy expression;
`bracketed_items` splits tuples and intervals. Nothing here imports `extract.py` or the rewards.
"""

from __future__ import annotations

MAX_EXPONENT = 10_000
"""The reader does not read a numeric power above this (`9^{9^9}` is not an answer to check)."""

_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\displaystyle", "\\$", "$", "~")
_RENAMED = {"\\dfrac": "\\frac", "\\tfrac": "\\frac", "\\cdot": "*", "\\times": "*", "\\div": "/", "\\le": "<=",
            "\\ge": ">=", "\\%": "", "%": "", "^\\circ": "", "^{\\circ}": "", "\\circ": "", "{,}": ","}
_TEXT_COMMANDS = ("\\text{", "\\textbf{", "\\mbox{", "\\mathrm{", "\\textnormal{")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """(the contents of the `{...}` group opening at text[start], the index after it), braces counted."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for index in range(start, len(text)):
        depth += 1 if text[index] == "{" else -1 if text[index] == "}" else 0
        if depth == 0:
            return text[start + 1:index], index + 1
    return None


def _strip_text(text: str) -> str:
    """`\\text{...}` groups removed (units, words), or their contents kept when nothing else is left."""
    kept, dropped, index = [], [], 0
    while index < len(text):
        command = next((c for c in _TEXT_COMMANDS if text.startswith(c, index)), None)
        group = _braced(text, index + len(command) - 1) if command else None
        if group is None:
            kept.append(text[index])
            index += 1
            continue
        dropped.append(group[0])
        index = group[1]
    rest = "".join(kept).strip()
    return rest if rest else "".join(dropped).strip()


def math_normal_form(answer: str) -> str:
    """A final answer as the math checker reads it: `$`, sizing and spacing commands, `\\text{}`
    units, degrees and percent signs dropped; `\\dfrac` read as `\\frac`; a leading `x =` dropped;
    thousands separators (`1,234`) and spaces removed; a trailing period dropped."""
    text = _strip_text(answer)
    for command in _DROPPED:
        text = text.replace(command, "")
    for command, replacement in _RENAMED.items():
        text = text.replace(command, replacement)
    text = text.strip().rstrip(".").strip()
    head, equals, tail = text.partition("=")
    if equals and len(head.strip()) == 1 and head.strip().isalpha() and "=" not in tail:
        text = tail
    text = "".join(text.split())
    digits_groups = text.split(",")
    if len(digits_groups) > 1 and digits_groups[0].lstrip("-").isdigit() and all(len(g) == 3 and g.isdigit() for g in digits_groups[1:]):
        text = "".join(digits_groups)
    return text


class LatexReader:
    """Recursive descent over a normalised answer: numbers (exact rationals), single-letter symbols,
    `\\pi`, `\\infty`, `\\frac{}{}`, `\\sqrt{}` / `\\sqrt[n]{}`, `+ - * / ^`, brackets and implicit
    products (`2x`, `3\\sqrt{2}`). Anything else raises ValueError: the answer is not read as math."""

    def __init__(self, text: str):
        import sympy

        self.sympy, self.text, self.index = sympy, text, 0

    def read(self):
        value = self.sum()
        if self.index != len(self.text):
            raise ValueError(f"unexpected {self.text[self.index:self.index + 10]!r}")
        return value

    def peek(self, token: str) -> bool:
        return self.text.startswith(token, self.index)

    def take(self, token: str) -> bool:
        if self.peek(token):
            self.index += len(token)
            return True
        return False

    def sum(self):
        value = self.product()
        while self.index < len(self.text) and self.text[self.index] in "+-":
            sign = self.text[self.index]
            self.index += 1
            term = self.product()
            value = value + term if sign == "+" else value - term
        return value

    def product(self):
        value = self.power()
        while True:
            if self.take("*"):
                value = value * self.power()
            elif self.take("/"):
                value = value / self.power()
            elif self.index < len(self.text) and (self.text[self.index].isalnum() or self.text[self.index] in "\\({["):
                value = value * self.power()  # an implicit product: 2x, 3\sqrt{2}, (1)(2)
            else:
                return value

    def power(self):
        if self.take("-"):
            return -self.power()
        if self.take("+"):
            return self.power()
        base = self.atom()
        if self.take("^"):
            exponent = self.group() if self.peek("{") else self.digit() if self.text[self.index:self.index + 1].isdigit() else self.atom()
            if exponent.is_number and abs(exponent) > MAX_EXPONENT:
                raise ValueError(f"exponent over {MAX_EXPONENT}")
            return self.sympy.Pow(base, exponent)
        return base

    def digit(self):
        if self.index >= len(self.text) or not self.text[self.index].isdigit():
            raise ValueError("\\frac without braces takes two digits")
        self.index += 1
        return self.sympy.Integer(self.text[self.index - 1])

    def group(self):
        found = _braced(self.text, self.index)
        if found is None:
            raise ValueError("unclosed brace")
        self.index = found[1]
        return LatexReader(found[0]).read()

    def atom(self):
        sympy, text = self.sympy, self.text
        if self.index >= len(text):
            raise ValueError("expression ends early")
        char = text[self.index]
        if char.isdigit() or char == ".":
            start = self.index
            while self.index < len(text) and (text[self.index].isdigit() or text[self.index] == "."):
                self.index += 1
            number = text[start:self.index]
            if number.count(".") > 1 or number == ".":
                raise ValueError(f"not a number: {number!r}")
            return sympy.Rational(number)
        if char.isascii() and char.isalpha():
            self.index += 1
            return sympy.Symbol(char)
        for opening, closing in (("(", ")"), ("[", "]"), ("{", "}")):
            if char == opening:
                self.index += 1
                value = self.sum()
                if not self.take(closing):
                    raise ValueError(f"unclosed {opening}")
                return value
        if self.take("\\frac"):
            if self.peek("{"):
                numerator = self.group()
                denominator = self.group() if self.peek("{") else self.atom()
            else:  # \frac12: one character each
                numerator, denominator = self.digit(), self.digit()
            return numerator / denominator
        if self.take("\\sqrt"):
            root = 2
            if self.take("["):
                end = text.find("]", self.index)
                if end < 0:
                    raise ValueError("unclosed [")
                root = LatexReader(text[self.index:end]).read()
                self.index = end + 1
            radicand = self.group() if self.peek("{") else self.atom()
            return sympy.root(radicand, root)
        if self.take("\\pi"):
            return sympy.pi
        if self.take("\\infty"):
            return sympy.oo
        raise ValueError(f"cannot read {text[self.index:self.index + 10]!r}")


def _split_top_level(text: str) -> list[str]:
    """`text` split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return parts + [text[start:]]


def bracketed_items(text: str) -> tuple[str, list[str]]:
    """(the outer bracket pair, the items) of `(1,2)` / `[0,1)`, or ("", [text]) for one value."""
    if len(text) >= 2 and text[0] in "([" and text[-1] in ")]" and len(_split_top_level(text[1:-1])) > 1:
        return text[0] + text[-1], _split_top_level(text[1:-1])
    return "", _split_top_level(text)
