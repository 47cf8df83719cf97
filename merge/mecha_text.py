"""The ``.mecha`` text format: reads sd-mecha's ``version 0.1.0`` files into recipes, so recipes port
between the two (writing: merge/mecha_write.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from . import recipe as rc
from .graph import CallNode, FreeInput, LiteralNode, ModelNode, Node, ParamNode, RecipeError
from .mecha_write import VERSION, dumps, lora_base  # noqa: F401 - dumps is part of this API

CONSTANTS = {"null": None, "true": True, "false": False}
COLLAPSED_CONVERSIONS = ("convert_singleton", "convert_sd1_blocks_to_ldm", "convert_sdxl_blocks_to_sgm")
_LORA_CONVERSION = re.compile(r"convert_'(?:sd1|sdxl)-kohya_(?:kohya|lycoris)_lora'_to_base")
_BASE_CONVERSION = re.compile(r"convert_'((?:sd1|sdxl)-kohya)'_to_'(?:sd1-ldm|sdxl-sgm)'")
IMPLEMENTATIONS = {  # sd-mecha writes the implementation it dispatched to, ours is the one method
    "exchange_ema_'sd1-ldm'": "exchange_ema",
    "balance_attention_sdxl_sgm": "balance_attention",
}
LEFT_OUT = (  # sd-mecha 1.1.8 built-ins Patchbay does not have (docs/merge-methods.md says why): the remedy
    (re.compile(r"get_dtype"), 'write the dtype itself (cast(a, dtype="float16")): every input is fp32 here'),
    (re.compile(r"get_device"), "leave the device out: the merge's device option places every tensor"),
    (re.compile(r"(rebasin|randperm)(_sdxl_sgm)?"),
     "leave it out (re-basin needs a permutation spec per family: docs/merge-methods.md)"),
    (re.compile(r"extract_(kohya|lycoris)_(lora|lokr)|extract_(lora|lokr)_'.*'"),
     "extract with `patchbay_merge.py extract` (--lokr RATIO for a LoKr) or the Extract LoRA node instead"),
)


class MechaSyntaxError(ValueError):
    """A .mecha text that cannot be read; ``line`` and ``column`` are 1-based."""

    def __init__(self, line: int, column: int, problem: str, text: str = "") -> None:
        self.line, self.column, self.problem = line, column, problem
        shown = f"\n    {text}\n    {' ' * (column - 1)}^" if text else ""
        super().__init__(f"line {line}, column {column}: {problem}{shown}")


@dataclass(frozen=True)
class _Token:
    column: int
    key: str | None
    value: Any
    value_column: int
    text: str  # the value as written (messages show this, never a Python repr)


@dataclass(frozen=True)
class _Ref:
    index: int


class _Map(dict):
    """The result of a ``dict`` line, before a ``literal`` line or a parameter takes it."""


# ---- reading -------------------------------------------------------------------------------------

def parse(text: str) -> Node:
    """The recipe a .mecha text describes; ``MechaSyntaxError`` (line, column) when it is malformed.

    One instruction per line after the ``version 0.1.0`` header; ``&N`` refers to the N-th
    instruction (0-based, comment lines ``#`` not counted); the last instruction is the result.
    As in sd-mecha, a blank line (a trailing newline too) is an error.

        model "path" [model_config="id"] [merge_space="weight|delta|param"]
        dict key=value ...                     a map (block names, key globs, default)
        literal &N|value model_config=... merge_space=...
        merge "method" &N ... [name=value|&N ...]
        input "name" [merge_space=...]         Patchbay: an open tensor input (FreeInput)
        param "name"                           Patchbay: an open scalar parameter (ParamNode)

    sd-mecha writes every scalar as three lines (``dict key=v`` / ``literal &N
    model_config="singleton-mecha"`` / ``merge "convert_singleton" &N``); ``parse`` collapses that,
    and the block-map conversions, to one LiteralNode, and reads its LoRA conversion calls
    (``merge "convert_'sd1-kohya_kohya_lora'_to_base" &N`` then ``"convert_'sd1-kohya'_to_'sd1-ldm'"``)
    as the LoRA file in delta space, and the per-model implementations sd-mecha dispatched to
    (``balance_attention_sdxl_sgm``) as the method itself. ``dumps`` (merge/mecha_write.py) writes
    sd-mecha's form or a compact one; ``parse(dumps(r)) == r`` for recipes made by the builders of
    merge/recipe.py (a block map with ``default`` comes back with the default spread over the blocks).
    """
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # a file saved with CRLF reads the same
    if lines[0] != VERSION:
        raise MechaSyntaxError(1, 1, f"expected the header {VERSION!r}, got {lines[0]!r}", lines[0])
    results: list[Any] = []
    for number, line in enumerate(lines[1:], start=2):
        if line.strip().startswith("#"):
            continue
        if not line.strip():
            raise MechaSyntaxError(number, 1, "blank line (sd-mecha rejects blank lines and a trailing "
                                              "newline; remove it)")
        column = len(line) - len(line.lstrip(" ")) + 1
        try:
            results.append(_instruction(line, column, results, number))
        except RecipeError as exc:
            raise MechaSyntaxError(number, column, str(exc), line) from None
    if not results:
        raise MechaSyntaxError(len(lines), 1, "no instruction after the version header")
    if not isinstance(results[-1], (ModelNode, CallNode, FreeInput)):
        raise MechaSyntaxError(len(lines), 1, "the last instruction must be a model, merge or input")
    return results[-1]


def _tokens(line: str, i: int, number: int) -> list[_Token]:
    tokens = []
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        start, key = i, None
        end_key = _key_end(line, i, number)
        if end_key is not None:
            key, i = line[i:end_key], end_key + 1
        value_column, value_start = i + 1, i
        if i < len(line) and line[i] == '"':
            value, i = _quoted(line, i, number)
        else:
            end = line.find(" ", i)
            end = len(line) if end < 0 else end
            value, i = _bare(line, i, end, number), end
        tokens.append(_Token(start + 1, key, value, value_column, line[value_start:i]))
    return tokens


def _key_end(line: str, i: int, number: int) -> int | None:
    """Index of the '=' ending a ``key=`` prefix at ``i``, if the token has one."""
    for j in range(i, len(line)):
        if line[j] in ' "':
            return None
        if line[j] == "=":
            if j == i:
                raise MechaSyntaxError(number, i + 1, "'=' without a name before it", line)
            return j
    return None


def _quoted(line: str, i: int, number: int) -> tuple[str, int]:
    out, j = [], i + 1
    while j < len(line):
        ch = line[j]
        if ch == "\\" and j + 1 < len(line):
            out.append(line[j + 1])
            j += 2
            continue
        if ch == '"':
            if j + 1 < len(line) and line[j + 1] != " ":
                raise MechaSyntaxError(number, j + 2, "expected a space after the closing quote", line)
            return "".join(out), j + 1
        out.append(ch)
        j += 1
    raise MechaSyntaxError(number, i + 1, "unterminated string (no closing quote)", line)


def _bare(line: str, i: int, end: int, number: int) -> Any:
    word = line[i:end]
    if not word:
        raise MechaSyntaxError(number, i + 1, "a value is missing after '='", line)
    if '"' in word:
        raise MechaSyntaxError(number, i + 1 + word.index('"'), "unexpected quote inside a value", line)
    if word in CONSTANTS:
        return CONSTANTS[word]
    try:
        if word.startswith("&"):
            return _Ref(int(word[1:]))
        value = float(word) if ("." in word or "e" in word.lower()) else int(word)
    except ValueError:
        raise MechaSyntaxError(number, i + 1, f"{word!r} is not a number, reference (&N), string "
                                              f"(in quotes), true, false or null", line) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise MechaSyntaxError(number, i + 1, f"{word} is beyond the float range (it would read as "
                                              f"{value}); give a finite number", line)
    return value


def _instruction(line: str, column: int, results: list[Any], number: int) -> Any:
    command = line[column - 1:].split(" ", 1)[0]
    handler = _COMMANDS.get(command)
    if handler is None:
        raise MechaSyntaxError(number, column, f"unknown instruction {command!r}; expected one of "
                                               f"{', '.join(_COMMANDS)}", line)
    tokens = _tokens(line, column - 1 + len(command), number)
    _check_strings(command, tokens, number, line)
    args = [_resolve(t, results, number, line) for t in tokens if t.key is None]
    kwargs: dict[str, Any] = {}
    for t in tokens:
        if t.key is not None:
            if t.key in kwargs:
                raise MechaSyntaxError(number, t.column, f"{t.key}= given twice", line)
            kwargs[t.key] = _resolve(t, results, number, line)
    try:
        return handler(args, kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        if isinstance(exc, (MechaSyntaxError, RecipeError)):
            raise
        raise MechaSyntaxError(number, column, f"{command}: {exc}", line) from None


# the values each instruction takes as quoted strings: (names of its leading positional values, keywords)
_STRINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "model": (("the model path", "the model_config", "the merge_space"), ("model_config", "merge_space")),
    "merge": (("the method name",), ()),
    "input": (("input name",), ("merge_space",)),
    "param": (("parameter name",), ()),
    "literal": ((), ("model_config", "merge_space")),
}
_USAGE = {"model": 'model "path" [model_config="id"] [merge_space="weight|delta|param"]',
          "merge": 'merge "method" &N ... [name=value ...]', "input": 'input "name" [merge_space="..."]',
          "param": 'param "name"', "literal": "literal value|&N [model_config=...] [merge_space=...]"}


def _check_strings(command: str, tokens: list[_Token], number: int, line: str) -> None:
    """Refuse a value written where the instruction takes a quoted string (a number, a reference, a
    stray token after a model line), naming it as written."""
    names, keywords = _STRINGS.get(command, ((), ()))
    positional = [t for t in tokens if t.key is None]
    checked = [(what, t, index > 0) for index, (what, t) in enumerate(zip(names, positional, strict=False))]
    checked += [(f"{t.key}=", t, True) for t in tokens if t.key in keywords]
    for what, token, optional in checked:  # sd-mecha writes null for an unset config or space
        if isinstance(token.value, str) or (optional and token.value is None):
            continue
        kind = ("a reference to an earlier line" if isinstance(token.value, _Ref)
                else "a number" if isinstance(token.value, (int, float)) and not isinstance(token.value, bool)
                else "a constant")
        if what.endswith(" name") and command in ("input", "param"):
            problem = (f"{what} {token.text} must be an identifier (a quoted name such as \"alpha\"), "
                       f"not {kind}")
        else:
            problem = f"{what} must be a quoted string, got {token.text} ({kind}); write {_USAGE[command]}"
        raise MechaSyntaxError(number, token.value_column, f"{command}: {problem}", line)


def _resolve(token: _Token, results: list[Any], number: int, line: str) -> Any:
    if isinstance(token.value, _Ref):
        if not 0 <= token.value.index < len(results):
            problem = f"reference &{token.value.index} points past the {len(results)} lines before it"
            raise MechaSyntaxError(number, token.value_column, problem, line)
        return results[token.value.index]
    return token.value


def _takes(args: list, least: int, most: int | None, usage: str) -> None:
    """Refuse a wrong number of positional values (``most`` None: no upper bound), showing the form."""
    if len(args) < least or (most is not None and len(args) > most):
        raise ValueError(f"takes {usage}, got {len(args)} positional value{'s' * (len(args) != 1)}")


def _quoted_arg(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a quoted string, got {value!r}")
    return value


def _model(args: list, kwargs: dict) -> ModelNode:
    _takes(args, 1, 3, 'a quoted path: model "a.safetensors"')
    path, *rest = args
    path = _quoted_arg(path, "the model path")
    config = kwargs.pop("model_config", rest[0] if rest else None)
    space = kwargs.pop("merge_space", rest[1] if len(rest) > 1 else "weight")
    _no_extra(kwargs)
    return rc.model(path, space or "weight", config)


def _dict(args: list, kwargs: dict) -> _Map:
    if args:
        raise ValueError("takes only name=value entries")
    return _Map(kwargs)


def _literal(args: list, kwargs: dict) -> LiteralNode:
    _takes(args, 1, 1, "one value or &N reference")
    (value,) = args
    kwargs.pop("model_config", None)
    kwargs.pop("merge_space", None)
    _no_extra(kwargs)
    if isinstance(value, _Map) and set(value) == {"key"}:
        return LiteralNode(value["key"])
    return LiteralNode(dict(value) if isinstance(value, _Map) else value)


def _merge(args: list, kwargs: dict) -> Node:
    _takes(args, 1, None, 'a quoted method name, then its inputs: merge "weighted_sum" &0 &1')
    method, *inputs = args
    method = _quoted_arg(method, "the method name")
    if method in COLLAPSED_CONVERSIONS and len(inputs) == 1 and isinstance(inputs[0], LiteralNode):
        return inputs[0]
    if method.startswith("convert_'"):
        return _conversion(method, inputs)
    method = IMPLEMENTATIONS.get(method, method)
    for pattern, remedy in LEFT_OUT:
        if pattern.fullmatch(method):
            raise ValueError(f"sd-mecha's {method!r} is not a Patchbay method; {remedy}")
    values = [LiteralNode(dict(v)) if isinstance(v, _Map) else v for v in inputs]
    named = {k: LiteralNode(dict(v)) if isinstance(v, _Map) else v for k, v in kwargs.items()}
    return rc.call(method, *values, **named)


def _conversion(method: str, inputs: list) -> ModelNode:
    """sd-mecha's LoRA conversion calls read as what they mean: the LoRA file as a delta-space input
    (merge/lora.py maps its kohya names onto the base model's keys)."""
    (node,) = inputs if len(inputs) == 1 else (None,)
    lora = _LORA_CONVERSION.fullmatch(method)
    if lora and isinstance(node, ModelNode) and node.config == method[len("convert_'"):-len("'_to_base")]:
        return rc.model(node.path, "delta", node.config)
    base = _BASE_CONVERSION.fullmatch(method)
    if base and isinstance(node, ModelNode) and lora_base(node) == base[1]:
        return node
    raise ValueError(f"sd-mecha's conversion {method!r} is not supported here; Patchbay reads kohya and "
                     'LyCORIS LoRAs directly: write the LoRA as model "lora.safetensors" merge_space="delta"')


def _input(args: list, kwargs: dict) -> FreeInput:
    _takes(args, 1, 1, 'one quoted name: input "x"')
    (name,) = args
    space = kwargs.pop("merge_space", "any")
    _no_extra(kwargs)
    return rc.free_input(name, space)


def _param(args: list, kwargs: dict) -> ParamNode:
    _takes(args, 1, 1, 'one quoted name: param "alpha"')
    (name,) = args
    _no_extra(kwargs)
    return rc.param(name)


def _no_extra(kwargs: dict) -> None:
    if kwargs:
        raise ValueError(f"unexpected {', '.join(f'{k}=' for k in kwargs)}")


_COMMANDS = {"model": _model, "dict": _dict, "literal": _literal, "merge": _merge,
             "input": _input, "param": _param}
