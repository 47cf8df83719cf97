"""Write the help page of every merge method node (web/docs/PatchbayMethod<Name>/en.md) from
merge.method_registry, and every node's locale-neutral fallback page (web/docs/<NodeId>.md, a copy of en.md).

    python devtools/build_merge_docs.py          # (re)write the pages
    python devtools/build_merge_docs.py --check  # exit 1 if a page is missing or differs

ComfyUI's frontend (1.32.9, 1.49.6 and 1.58.1 alike: NodeHelpService.fetchCustomNodeHelp) asks for
``/extensions/<pack>/docs/<NodeId>/<locale>.md`` first and ``docs/<NodeId>.md`` after a 404, so the
English page is ``web/docs/<NodeId>/en.md`` (found on the first request) and its copy ``<NodeId>.md``
serves every other locale. Relative image links resolve against ``docs/`` in both. Method nodes are
generated from the registry (nodes/merge_methods.py), so their pages are too: the method's one-line
doc, its paper, its inputs with their merge spaces and its parameters with type, default and range. A
T1 test (tests/test_t1_merge_nodes.py) checks the pages match the registered methods and the node ids.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pack_imports

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "web" / "docs"
VARIADIC_SLOTS = 10  # nodes/merge_methods.py
SPACES = {"weight": "a model (weight space)", "delta": "a difference (delta space: `subtract`, a LoRA)",
          "param": "a per-element parameter (param space)", "any": "a model or a difference"}

MAP_NOTE = ("Every numeric parameter also has an optional `<parameter>_map` input: connect Merge Block "
            "Weights (SD1.5 / SDXL / Flux) or Merge Key Patterns to set it per block or key, or a "
            "param-space recipe (`train_difference_mask`). It replaces the widget's value.")


def node_id(name: str) -> str:
    """The node id nodes/merge_methods.py gives method ``name`` (checked by the T1 test)."""
    return "PatchbayMethod" + "".join(part.capitalize() for part in name.split("_"))


def _range(spec) -> str:
    if spec.range is None:
        return ""
    high = "" if math.isinf(spec.range.high) else f"{spec.range.high:g}"
    return f"{spec.range.low:g} .. {high}".rstrip()


def _default(spec) -> str:
    if spec.default is None:
        return "none (-1 in the widget)" if spec.type is int else "none (empty)"
    return f"`{spec.default!r}`" if spec.type is str else f"`{spec.default}`"


def page(method) -> str:
    """The markdown help page of one method node."""
    lines = [f"# {method.name} (Patchbay merge)", "", method.doc, ""]
    if method.paper:
        lines += [f"Paper / origin: <{method.paper}>", ""]
    lines += ["## Inputs", "", "| input | takes |", "|---|---|"]
    for spec in method.inputs:
        if spec.variadic:
            lines.append(f"| `{spec.name}_1` .. `{spec.name}_{VARIADIC_SLOTS}` | {SPACES[spec.space]}; "
                         f"connect one or more, leave the rest unconnected |")
        else:
            lines.append(f"| `{spec.name}` | {SPACES[spec.space]} |")
    if method.params:
        lines += ["", "## Parameters", "", "| parameter | type | default | range |", "|---|---|---|---|"]
        lines += [f"| `{p.name}` | {p.type.__name__}{' or none' if p.optional else ''} | {_default(p)} | "
                  f"{_range(p)} |" for p in method.params]
        if any(p.type in (float, int) for p in method.params):
            lines += ["", MAP_NOTE]
    output = (f"`recipe`: one {method.returns.__name__} per key. Connect it to the `<parameter>_map` input "
              f"of a parameter of that type (truncate_rank's `rank_map`)." if method.returns else
              f"`recipe`: {SPACES[method.output]}. Connect it to another method node, or to Merge (a MODEL, "
              f"CLIP and VAE in the graph), Save Merge (a checkpoint file) or Extract LoRA.")
    lines += ["", "## Output", "", output, "",
              "Names, formulas and defaults follow sd-mecha 1.1.8, or mergekit's formulas for the methods "
              "taken from it; docs/merge-methods.md gives each formula and any difference.",
              "",
              "<!-- generated from merge.method_registry by devtools/build_merge_docs.py -->", ""]
    return "\n".join(lines)


def help_page(node: str, locale: str = "en") -> Path:
    """Where the help page of node id ``node`` in ``locale`` lives."""
    return DOCS / node / f"{locale}.md"


def pages(registry=None) -> dict[Path, str]:
    """Every page this script writes: the method pages, then each node's fallback copy of its en.md.
    ``registry``: the merge registry module to read (a T1 test passes the loaded pack's, so that its
    process holds merge/ under one name); None: ``patchbay_merge.method_registry``."""
    if registry is None:
        pack_imports.use_standalone_names()  # here, not at import: a T1 test imports this module
        from patchbay_merge import method_registry as registry

    written = {help_page(node_id(m.name)): page(m) for m in registry.all_methods()}
    english = {path.parent.name: path for path in DOCS.glob("*/en.md")}
    english.update({path.parent.name: path for path in written})
    return written | {DOCS / f"{node}.md": written.get(path) or path.read_text()
                      for node, path in sorted(english.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check the pages")
    args = parser.parse_args(argv)
    stale = [path for path, text in pages().items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run devtools/build_merge_docs.py)")
        return 1 if stale else 0
    wanted = pages()
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
