"""Writing recipes as ``.mecha`` text: the form sd-mecha 1.1.8 reads back, or a compact one (``dumps``,
re-exported by merge/mecha_text.py, which reads both forms back into the same recipe).
"""

from __future__ import annotations

import math
import re
from typing import Any

from . import recipe as rc
from .blocks import block_names
from .graph import CallNode, FreeInput, LiteralNode, ModelNode, Node, ParamNode

VERSION = "version 0.1.0"
BLOCK_CONFIGS = {"sd15": ("sd1-supermerger_blocks", "convert_sd1_blocks_to_ldm"),
                 "sdxl": ("sdxl-supermerger_blocks", "convert_sdxl_blocks_to_sgm")}
LORA_TARGETS = {"sd1-kohya": "sd1-ldm", "sdxl-kohya": "sdxl-sgm"}  # sd-mecha's kohya key config -> checkpoint
_LORA_CONFIG = re.compile(r"((?:sd1|sdxl)-kohya)_(?:kohya|lycoris)_lora")


def dumps(root: Node, *, arch: str | None = None, compact: bool = False) -> str:
    """The .mecha text of ``root`` (no trailing newline): scalars inline, parameters at their default
    left out, identical lines shared.

    By default the form sd-mecha 1.1.8 reads back: every model line carries its ``merge_space``, a
    block map of an SD1.5 or SDXL recipe is sd-mecha's block literal (``dict`` with every block, a
    ``default`` spread over the blocks it does not name, then ``literal`` and the block conversion),
    and a LoRA read from sd-mecha's conversion calls is written with them again. ``arch`` (``sd15``,
    ``sdxl``) names the block set; without it, it is read off the recipe's model configs or block
    names. Maps with key globs or key names, and Flux block maps, have no sd-mecha form and stay
    ``dict`` lines. ``compact=True``: the shortest text Patchbay reads (no ``merge_space="weight"``,
    every map a ``dict`` line).
    """
    writer = _Writer(compact, arch if arch is not None else _recipe_arch(root))
    writer.emit(root)
    return "\n".join([VERSION, *writer.lines])


def _recipe_arch(root: Node) -> str | None:
    """sd15 or sdxl when the recipe's model configs or its block names tell, else None."""
    names = {n.config or "" for _, n in rc.walk(root) if isinstance(n, ModelNode)}
    names |= {k for _, n in rc.walk(root) if isinstance(n, LiteralNode) and n.is_map for k in n.mapping}
    sd15, sdxl = (any(n.startswith(p) for n in names) for p in ("sd1-", "sdxl-"))
    sd15 = sd15 or bool(names & {"IN09", "IN10", "IN11", "OUT09", "OUT10", "OUT11"})
    sdxl = sdxl or "VAE" in names
    return "sd15" if sd15 and not sdxl else "sdxl" if sdxl and not sd15 else None


class _Writer:
    """The lines written so far and the reference of every node already written."""

    def __init__(self, compact: bool, arch: str | None) -> None:
        self.compact, self.arch = compact, arch
        self.lines: list[str] = []
        self.memo: dict[int, str] = {}

    def emit(self, node: Node) -> str:
        if id(node) not in self.memo:
            self.memo[id(node)] = self.add(self._line(node))
        return self.memo[id(node)]

    def add(self, line: str) -> str:
        if line not in self.lines:
            self.lines.append(line)
        return f"&{self.lines.index(line)}"

    def _line(self, node: Node) -> str:
        if isinstance(node, ModelNode):
            return self._model(node)
        if isinstance(node, FreeInput):
            return f"input {_string(node.name)}" + _option("merge_space", node.space, "any")
        if isinstance(node, ParamNode):
            return f"param {_string(node.name)}"
        if isinstance(node, LiteralNode):
            return self._map(node)
        return self._merge(node)

    def _model(self, node: ModelNode) -> str:
        line = f"model {_string(node.path)}" + _option("model_config", node.config, None)
        base = lora_base(node)
        if self.compact or base is None:
            return line + _option("merge_space", node.space, "weight" if self.compact else None)
        ref = self.add(f'{line} merge_space="weight"')
        ref = self.add(f"merge {_string(f'convert_{node.config!r}_to_base')} {ref}")
        return f"merge {_string(f'convert_{base!r}_to_{LORA_TARGETS[base]!r}')} {ref}"

    def _map(self, node: LiteralNode) -> str:
        if not node.is_map:
            raise ValueError(f"a scalar literal ({node.value!r}) is written inline, not as a line")
        blocks = block_names(self.arch) if self.arch in BLOCK_CONFIGS and not self.compact else ()
        entries = node.mapping
        if not blocks or not set(entries) - {"default"} <= set(blocks):
            return "dict " + " ".join(f"{k}={_scalar(v)}" for k, v in node.value)
        if "default" in entries:
            entries = {b: entries.get(b, entries["default"]) for b in blocks}
        config, conversion = BLOCK_CONFIGS[self.arch]
        ref = self.add("dict " + " ".join(f"{b}={_scalar(entries[b])}" for b in blocks if b in entries))
        ref = self.add(f"literal {ref} model_config={_string(config)} merge_space=null")
        return f"merge {_string(conversion)} {ref}"

    def _merge(self, node: CallNode) -> str:
        spec = rc.registry.get(node.method)
        parts = ["merge", _string(node.method), *(self.emit(a) for a in node.args)]
        for name, value in node.kwargs:
            if name in spec.param_names() and value == LiteralNode(spec.param(name).default):
                continue
            inline = isinstance(value, LiteralNode) and not value.is_map
            parts.append(f"{name}={_scalar(value.value) if inline else self.emit(value)}")
        return " ".join(parts)


def _option(name: str, value: str | None, default: str | None) -> str:
    return "" if value == default else f" {name}={_scalar(value)}"


def _scalar(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} cannot be written to a .mecha file (not finite)")
        return repr(value)
    return str(value)


def _string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def lora_base(node: ModelNode) -> str | None:
    """``sd1-kohya`` for a delta ModelNode whose config is sd-mecha's ``sd1-kohya_kohya_lora`` (etc.)."""
    match = _LORA_CONFIG.fullmatch(node.config or "")
    return match[1] if match and node.space == "delta" else None
