"""The merge command line (merge, extract, lora-stack, show, validate, methods), run through
``devtools/patchbay_merge.py`` or ``main([...])``; every user error is one ``error:`` line, status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXIT_USER_ERROR = 2
EXIT_BUG = 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run one subcommand; returns the exit status.

    Every failure ends in one line on stderr, never a traceback: user errors (exit 2), an
    interrupt by Ctrl-C or SIGTERM (130 / 143, the temporary output deleted) and, should one
    remain, an engine bug (exit 1, named as such).

    A user error (bad recipe, missing or broken model, existing output) writes nothing. Usage::

        patchbay_merge.py merge recipe.mecha out.safetensors [--dtype fp16] [--param alpha=0.3] ...
        patchbay_merge.py extract delta.mecha lora.safetensors --rank 32 | --energy 0.9 | --lokr 0.5
        patchbay_merge.py lora-stack out.safetensors a.safetensors:0.8 b.safetensors:-0.5 --rank 32
        patchbay_merge.py show recipe.mecha [--compact]
        patchbay_merge.py validate recipe.mecha
        patchbay_merge.py methods
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _terminate_as_interrupt():
            return args.run(args)
    except (ValueError, KeyError, OSError, ArithmeticError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Terminated:
        print("terminated: nothing was written", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        text = str(error).replace("\n", " ")
        print(f"error: unexpected {type(error).__name__} ({text}); nothing was written. This is a bug in "
              f"Patchbay's merge engine: please report it with the recipe", file=sys.stderr)
        return EXIT_BUG


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the merge cleans up exactly as after Ctrl-C."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# MergeOptions fields set by a --flag of ``merge`` (type, default and choices come from MergeOptions)
def build_parser() -> argparse.ArgumentParser:
    from .extract import ExtractOptions
    from .io import ARCHITECTURE_POLICIES, OUT_DTYPES

    parser = argparse.ArgumentParser(prog="patchbay_merge.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    merge = sub.add_parser("merge", help="merge a .mecha recipe into a .safetensors file")
    _recipe_args(merge)
    merge.add_argument("output", type=Path, help="the .safetensors file to write")
    _merge_option_args(merge)
    merge.set_defaults(run=run_merge)

    extract = sub.add_parser("extract", help="extract a kohya LoRA from a delta recipe (e.g. subtract(a, b))")
    _recipe_args(extract)
    extract.add_argument("output", type=Path, help="the LoRA .safetensors file to write")
    size = extract.add_mutually_exclusive_group()
    size.add_argument("--rank", type=int, help=f"rank of every module (default {ExtractOptions.rank})")
    size.add_argument("--energy", type=float, help="keep this fraction of each delta's spectral energy (0-1]")
    size.add_argument("--lokr", type=float, metavar="RATIO",
                      help="write a LoKr (lokr_w1, lokr_w2: the nearest Kronecker product) instead; RATIO in "
                           "[0, 1] sizes w1 (0.5: w1 and w2 of similar size)")
    extract.add_argument("--conv-rank", type=int, help="rank of 3x3 convolutions (default: --rank)")
    extract.add_argument("--dtype", choices=tuple(OUT_DTYPES), default=ExtractOptions.dtype,
                         help="(%(default)s)")
    extract.add_argument("--device", default=ExtractOptions.device, help="where the SVDs run (%(default)s)")
    extract.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    extract.add_argument("--architecture-policy", choices=ARCHITECTURE_POLICIES, default="refuse",
                         help="as for merge (%(default)s)")
    extract.set_defaults(run=run_extract)

    _lora_stack_args(sub)

    show = sub.add_parser("show", help="print a recipe as .mecha text (sd-mecha reads it too), its inputs "
                                       "and methods")
    _recipe_args(show)
    show.add_argument("--compact", action="store_true",
                      help="the shortest text (Patchbay reads it; sd-mecha needs the default form)")
    show.set_defaults(run=run_show)

    validate = sub.add_parser("validate", help="check a recipe and its model files without merging")
    _recipe_args(validate)
    validate.add_argument("--architecture-policy", choices=ARCHITECTURE_POLICIES, default="refuse",
                          help="as for merge (%(default)s)")
    validate.set_defaults(run=run_validate)

    methods = sub.add_parser("methods", help="list the merge methods with their one-line docs")
    methods.add_argument("--json", action="store_true", help="machine-readable output")
    methods.set_defaults(run=run_methods)
    return parser


def _lora_stack_args(sub: Any) -> None:
    from .stack_to_lora import StackOptions

    stack = sub.add_parser("lora-stack", help="merge LoRA files (each with a strength) into one LoRA of a "
                                              "chosen rank or energy")
    stack.add_argument("output", type=Path, help="the LoRA .safetensors file to write")
    stack.add_argument("loras", nargs="+", metavar="LORA[:STRENGTH[:CLIP_STRENGTH]]",
                       help="a LoRA file, its strength (1) and its strength on the text encoder (the same)")
    size = stack.add_mutually_exclusive_group()
    size.add_argument("--rank", type=int, help=f"rank of every module (default {StackOptions.rank})")
    size.add_argument("--energy", type=float,
                      help="keep this fraction of each module's spectral energy (0-1]")
    stack.add_argument("--blocks", action="append", default=[], metavar="N=MAP",
                       help='block weights of the Nth LoRA (1-based), e.g. 2=\'{"OUT*": 0, "default": 1}\' '
                            "(repeatable)")
    stack.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default=StackOptions.dtype,
                       help="(%(default)s)")
    stack.add_argument("--device", default=StackOptions.device, help="where the SVDs run (%(default)s)")
    stack.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    stack.set_defaults(run=run_lora_stack)


def merge_option_fields() -> list[dataclasses.Field]:
    """The ``MergeOptions`` fields that ``merge`` takes as flags of their own: every field but
    ``search_dirs``, which every subcommand takes as ``--models-dir`` (after the recipe's folder)."""
    from .plan import MergeOptions

    return [f for f in dataclasses.fields(MergeOptions) if f.name != "search_dirs"]


def _merge_option_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``MergeOptions`` field, named, typed and explained by the field (merge/plan.py): a
    True boolean becomes ``--no-<name>``, a False one ``--<name>``."""
    from .plan import MergeOptions

    for option in merge_option_fields():
        flag, help_text, default = option.name.replace("_", "-"), option.metadata["help"], option.default
        if isinstance(default, bool):
            parser.add_argument(f"--no-{flag}" if default else f"--{flag}", dest=option.name,
                                action="store_false" if default else "store_true", help=help_text)
        elif option.name == "spill_dir":
            parser.add_argument(f"--{flag}", type=Path, default=None, metavar="DIR", help=help_text)
        else:
            parser.add_argument(f"--{flag}", type=type(default), default=default,
                                choices=MergeOptions.CHOICES.get(option.name), help=help_text)


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, help="a .mecha file (sd-mecha 0.1.0 text)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="bind an open parameter (repeatable)")
    parser.add_argument("--models-dir", action="append", type=Path, default=[], metavar="DIR",
                        help="where to look for relative model paths (after the current folder "
                             "and the recipe's folder; repeatable)")


def load_recipe(args: argparse.Namespace) -> Any:
    """Parse the recipe file and bind ``--param`` values."""
    from . import mecha_text
    from . import recipe as rc

    if not args.recipe.is_file():
        raise FileNotFoundError(f"{args.recipe}: no such recipe file")
    try:
        text = args.recipe.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{args.recipe}: not a text file (byte {error.start} is not UTF-8); a recipe is "
                         f".mecha text starting with 'version 0.1.0' (a model file goes on a model line)"
                         ) from None
    try:
        root = mecha_text.parse(text.rstrip("\n"))
    except mecha_text.MechaSyntaxError as error:
        raise ValueError(f"{args.recipe}: {error}") from None
    params = dict(_param(text) for text in args.param)
    return rc.bind(root, params=params) if params else root


def _param(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--param {text!r}: write NAME=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _search_dirs(args: argparse.Namespace) -> tuple[Path, ...]:
    return (args.recipe.resolve().parent, *args.models_dir)


def run_merge(args: argparse.Namespace) -> int:
    from .execute import MergeOptions, merge

    options = MergeOptions(**{f.name: getattr(args, f.name) for f in merge_option_fields()},
                           search_dirs=_search_dirs(args))
    report = merge(load_recipe(args), args.output, options)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    size = report.bytes_written / 2**30
    print(f"wrote {report.path} ({report.keys} keys, {size:.2f} GiB, {report.arch}) "
          f"in {report.seconds:.1f} s")
    return 0


def run_extract(args: argparse.Namespace) -> int:
    from .extract import ExtractOptions, extract_lora

    rank = args.rank if args.rank is not None or args.energy is not None else ExtractOptions.rank
    options = ExtractOptions(rank=rank, energy=args.energy, conv_rank=args.conv_rank, dtype=args.dtype,
                             device=args.device, overwrite=args.overwrite, search_dirs=_search_dirs(args),
                             architecture_policy=args.architecture_policy, kronecker_ratio=args.lokr)
    report = extract_lora(load_recipe(args), args.output, options)
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {report.path} ({report.modules} modules, mean relative error {report.mean_error:.4f}) "
          f"in {report.seconds:.1f} s")
    return 0


def run_lora_stack(args: argparse.Namespace) -> int:
    from .stack_to_lora import StackEntry, StackOptions, merge_lora_stack

    blocks = dict(_stack_blocks(text, len(args.loras)) for text in args.blocks)
    entries = [StackEntry(*_stack_entry(text), blocks=blocks.get(n))
               for n, text in enumerate(args.loras, start=1)]
    rank = args.rank if args.rank is not None or args.energy is not None else StackOptions.rank
    options = StackOptions(rank=rank, energy=args.energy, dtype=args.dtype, device=args.device,
                           overwrite=args.overwrite)
    report = merge_lora_stack(entries, args.output, options)
    print("\n".join([f"wrote {report.path} in {report.seconds:.1f} s", *report.lines()]))
    return 0


def _stack_entry(text: str) -> tuple[Path, float, float | None]:
    """``path[:strength[:clip strength]]``: trailing numbers are strengths (a path may hold ``:``)."""
    parts, numbers = text.split(":"), []
    while len(parts) > 1 and len(numbers) < 2:
        try:
            numbers.insert(0, float(parts[-1]))
        except ValueError:
            break
        parts.pop()
    strength, clip = (*numbers, None, None)[:2] if numbers else (1.0, None)
    return Path(":".join(parts)), strength, clip


def _stack_blocks(text: str, count: int) -> tuple[int, dict[str, float]]:
    number, sep, value = text.partition("=")
    if not sep or not number.strip().isdigit() or not 1 <= int(number) <= count:
        raise ValueError(f"--blocks {text!r}: write N=MAP with N the LoRA's position, 1 to {count}, e.g. "
                         f"1='{{\"OUT*\": 0, \"default\": 1}}'")
    try:
        mapping = json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(f"--blocks {text!r}: the map is not JSON ({error.msg}); write e.g. "
                         f"'{{\"IN*\": 0.5, \"default\": 1}}'") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, (int, float)) for v in mapping.values()):
        raise ValueError(f"--blocks {text!r}: the map must give a number per block name or glob, e.g. "
                         f"'{{\"OUT*\": 0, \"default\": 1}}'")
    return int(number), {str(k): float(v) for k, v in mapping.items()}


def run_show(args: argparse.Namespace) -> int:
    from . import mecha_text
    from . import recipe as rc

    root = load_recipe(args)
    print(mecha_text.dumps(root, arch=_models_arch(root, _search_dirs(args)), compact=args.compact))
    models = sorted({n.path for _, n in rc.walk(root) if isinstance(n, rc.ModelNode)})
    methods = sorted({n.method for _, n in rc.walk(root) if isinstance(n, rc.CallNode)})
    print(f"# inputs: {', '.join(models)}")
    print(f"# methods: {', '.join(methods)}")
    if open_names := [*rc.free_inputs(root), *rc.params(root)]:
        print(f"# open (bind with --param): {', '.join(open_names)}")
    return 0


def _models_arch(root: Any, search_dirs: tuple[Path, ...]) -> str | None:
    """The architecture of the recipe's model files when they can be opened (block maps need it)."""
    from .executable import models_arch

    return models_arch(root, search_dirs)


def run_validate(args: argparse.Namespace) -> int:
    from .plan import MergeOptions, plan

    root = load_recipe(args)
    options = MergeOptions(search_dirs=_search_dirs(args), architecture_policy=args.architecture_policy)
    summary = plan(root, options)
    print(f"ok: {summary.keys} keys, {summary.arch}, {len(summary.sources)} inputs "
          f"({', '.join(summary.sources)})")
    for warning in summary.warnings:
        print(f"warning: {warning}")
    return 0


def run_methods(args: argparse.Namespace) -> int:
    from . import method_registry as registry

    methods = registry.all_methods()
    if args.json:
        print(json.dumps({m.name: m.doc for m in methods}, indent=1))
        return 0
    width = max(len(m.name) for m in methods)
    for method in methods:
        print(f"{method.name:<{width}}  {method.doc}")
    return 0
