"""Recipes as text: sd-mecha's ``.mecha`` read into the graph (a textbox or a file of the recipes folder),
and a graph's recipe printed so it can be copied to the command line (``patchbay-merge merge``)."""

from __future__ import annotations

import json
from typing import Any

from comfy_api.latest import io

from ..comfy_merge import files, runtime
from ..merge import mecha_text
from ..merge import recipe as R
from ..merge.executable import models_arch
from . import v3

RECIPE = "PATCHBAY_RECIPE"
TEXTBOX = "(textbox)"
INPUT_SLOTS = 4
EXAMPLE = ('version 0.1.0\nmodel "checkpoints/a.safetensors" merge_space="weight"\n'
           'model "checkpoints/b.safetensors" merge_space="weight"\nmerge "weighted_sum" &0 &1 alpha=0.5')

files.register_recipes_folder()


def parse_params(text: str) -> dict[str, Any]:
    """``name=value`` per line (``#`` comments); values read as JSON when they are (numbers, true, maps)."""
    values: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"params line {number}: {line!r} is not name=value (e.g. alpha=0.3)")
        try:
            values[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            values[name.strip()] = value.strip()
    return values


def recipe_from_text(text: str, inputs: list[Any], params_text: str = "") -> R.Node:
    """The recipe ``text`` describes, its open inputs bound in name order to ``inputs`` (None = not
    connected) and its open parameters to ``params_text``; every model path checked now."""
    root = mecha_text.parse(text.rstrip("\n"))
    open_inputs = R.free_inputs(root)
    connected = {f"input_{i + 1}": value for i, value in enumerate(inputs) if value is not None}
    if extra := [slot for slot in connected if int(slot.split("_")[1]) > len(open_inputs)]:
        raise ValueError(f"{extra[0]} is connected but the recipe has {len(open_inputs)} open input(s)"
                         f"{': ' + ', '.join(open_inputs) if open_inputs else ''}; disconnect it")
    bound = {name: connected[f"input_{i + 1}"] for i, name in enumerate(open_inputs)
             if f"input_{i + 1}" in connected}
    if missing := [(i, name) for i, name in enumerate(open_inputs) if name not in bound]:
        i, name = missing[0]
        raise ValueError(f"the recipe's open input {name!r} is not bound: connect a recipe to input_{i + 1} "
                         f"(open inputs are bound in name order: {', '.join(open_inputs)})")
    params = parse_params(params_text)
    root = R.bind(root, inputs=bound, params=params) if bound or params else root
    if unbound := R.params(root):
        raise ValueError(f"the recipe's parameter {unbound[0]!r} is not bound: add a line "
                         f"{unbound[0]}=<value> to params")
    for _, node in R.walk(root):
        if isinstance(node, R.ModelNode) and not isinstance(node, R.SourceNode):
            runtime.resolve(node.path)
    return root


def recipe_to_text(recipe: R.Node, compact: bool = False) -> str:
    """``recipe`` as .mecha text, block maps in its models' block names; a graph MODEL gets a comment."""
    text = mecha_text.dumps(recipe, arch=models_arch(recipe, resolve=runtime.resolve), compact=compact)
    graph = sorted({node.path for _, node in R.walk(recipe) if isinstance(node, R.SourceNode)})
    notes = [f"# {path} is a MODEL of the ComfyUI graph: save it (Save Merge, CheckpointSave) and name the "
             f"file here to use this recipe elsewhere" for path in graph]
    return "\n".join([text.split("\n", 1)[0], *notes, *text.split("\n")[1:]]) if notes else text


class PatchbayMergeRecipeText(v3.Node):
    NODE_ID = "PatchbayMergeRecipeText"
    DISPLAY_NAME = "Merge Recipe from Text (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        slots = [v3.RECIPE.Input(f"input_{i}", optional=True,
                                 tooltip=f"Bound to the recipe's open input number {i} (open inputs, 'input "
                                         f"\"name\"' lines, in name order).")
                 for i in range(1, INPUT_SLOTS + 1)]
        return v3.schema(
            cls, category="Patchbay/merge/recipes",
            description=("An sd-mecha .mecha recipe (typed, pasted, or a file of models/recipes) as a "
                         "recipe: model paths name ComfyUI folders (checkpoints/a.safetensors); open inputs "
                         "and parameters are bound here."),
            inputs=[
                io.String.Input("text", multiline=True, default=EXAMPLE,
                                tooltip=f".mecha text (version 0.1.0); used when recipe_file is {TEXTBOX}."),
                io.Combo.Input("recipe_file", options=[TEXTBOX, *files.recipe_names()],
                               tooltip="A .mecha file of the recipes folder (models/recipes), or the "
                                       "textbox."),
                io.String.Input("params", multiline=True, default="",
                                tooltip="name=value per line for the recipe's open parameters."),
                *slots,
            ],
            outputs=[v3.output(v3.RECIPE, "recipe",
                               "The recipe, for Merge, Save Merge, Extract LoRA or a method node's input.")])

    @classmethod
    def validate_inputs(cls, text: str | None = None, recipe_file: str | None = None) -> bool | str:
        if text is not None and recipe_file in (None, TEXTBOX):
            try:
                mecha_text.parse(text.rstrip("\n"))
            except ValueError as error:
                return f"recipe text: {error}"
        return True

    @classmethod
    def execute(cls, text: str, recipe_file: str = TEXTBOX, params: str = "", **inputs: Any) -> io.NodeOutput:
        source = text if recipe_file == TEXTBOX else files.recipe_text(recipe_file)
        slots = [inputs.get(f"input_{i}") for i in range(1, INPUT_SLOTS + 1)]
        return io.NodeOutput(recipe_from_text(source, slots, params))

    make = v3.v1_entry()


class PatchbayMergeRecipeToText(v3.Node):
    NODE_ID = "PatchbayMergeRecipeToText"
    DISPLAY_NAME = "Merge Recipe to Text (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category="Patchbay/merge/recipes", is_output_node=True,
            description=("A graph's recipe as .mecha text, shown in the node: copy it to a file and run "
                         "patchbay-merge merge recipe.mecha out.safetensors --models-dir ComfyUI/models."),
            inputs=[
                v3.RECIPE.Input("recipe", tooltip="Any recipe."),
                io.Combo.Input("form", options=["sd-mecha", "compact"],
                               tooltip="sd-mecha: the form sd-mecha 1.1.8 reads too; compact: the shortest "
                                       "text (Patchbay reads it)."),
            ],
            outputs=[v3.output(io.String, "text", "The recipe as .mecha text.")])

    @classmethod
    def execute(cls, recipe: R.Node, form: str = "sd-mecha") -> io.NodeOutput:
        text = recipe_to_text(recipe, compact=form == "compact")
        return io.NodeOutput(text, ui={"text": [text]})

    show = v3.v1_entry()


NODES = [PatchbayMergeRecipeText, PatchbayMergeRecipeToText]
