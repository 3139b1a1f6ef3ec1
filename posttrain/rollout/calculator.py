"""The `calculator` tool: arithmetic evaluated through `ast`, never `eval`: numbers, + - * / // %
** and parentheses, with every integer (operands and intermediate results) capped at MAX_INT_BITS
and the expression at MAX_EXPRESSION_CHARS, so `9**9**9` is refused before it starts."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


MAX_EXPRESSION_CHARS = 2000
MAX_INT_BITS = 4096
"""The largest integer (operands and every intermediate result) the calculator builds."""
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


def _bits(value: int | float) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _apply(op: ast.operator, left: int | float, right: int | float) -> int | float:
    """One binary operation, refused before it would build an integer over MAX_INT_BITS."""
    if type(op) is ast.Pow and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right > MAX_INT_BITS or (_bits(left) - 1) * right > MAX_INT_BITS:  # a lower bound: 9**9**9 never starts
            raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    if type(op) is ast.Mult and _bits(left) + _bits(right) > MAX_INT_BITS + 1:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    try:
        value = _OPERATORS[type(op)](left, right)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None
    if isinstance(value, complex):
        raise CalculatorError("complex result (a negative number to a fractional power)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    if _bits(value) > MAX_INT_BITS:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if _bits(node.value) > MAX_INT_BITS:
            raise CalculatorError(f"number too large (over {MAX_INT_BITS} bits)")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _apply(node.op, _evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"unsupported operator {type(node.op).__name__} (use + - * / // % ** and parentheses)")
    raise CalculatorError(f"unsupported expression: {type(node).__name__} (only numbers, + - * / // % ** and parentheses)")


def format_number(value: int | float) -> str:
    """An int as is; a float that is exactly an integer (below 2**53) as that integer; else repr.

    >>> format_number(6 / 3), format_number(0.5), format_number(2 ** 70)
    ('2', '0.5', '1180591620717411303424')
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, for example "(2 + 3) * 4 ** 2 / 7".

    >>> calculator("(2 + 3) * -4"), calculator("7 / 2"), calculator("2 ** 10 // 3")
    ('-20', '3.5', '341')
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an expression: {error.msg}") from None
    except ValueError as error:  # a NUL byte in the source
        raise CalculatorError(f"not an expression: {error}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression nested too deeply") from None
    try:
        return format_number(_evaluate(tree))
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
