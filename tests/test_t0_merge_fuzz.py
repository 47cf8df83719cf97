"""T0: seeded mutations of valid recipes through ``validate`` and ``merge`` on tiny files and a LoRA.

Each mutation (a method swapped for another, a value replaced by an odd one, a parameter added, a
token or a line deleted, duplicated or moved) goes through the command line in-process. Whatever
the text, the command ends in one ``error:`` line (exit 2) or a written file (exit 0): never a
traceback, never the catch-all's "unexpected" (a bug), never a file left behind. A recipe that
validates merges, or fails with a message naming the key and the method (numbers a method cannot
take), or stops at a non-finite result.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.t0

CASES = 600
KEYS = {"model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (3, 768),  # sd15
        "model.diffusion_model.input_blocks.1.0.in_layers.2.weight": (4, 3, 3, 3),
        "model.diffusion_model.middle_block.1.proj_in.weight": (5, 4),
        "model.diffusion_model.out.2.bias": (4,),
        "cond_stage_model.transformer.text_model.embeddings.position_ids": (1, 5)}
MODELS = ['model "a.safetensors"', 'model "b.safetensors"', 'model "c.safetensors"']
RECIPES = [
    ['merge "weighted_sum" &0 &1 alpha=0.3'],
    ["dict IN01=0.2 M00=0.7 default=0.5", 'merge "weighted_sum" &0 &1 alpha=&3'],
    ['merge "subtract" &1 &2', 'merge "add_difference" &0 &3 alpha=0.7'],
    ['merge "subtract" &1 &2', 'merge "train_difference_mask" &0 &1 &2 alpha=0.5',
     'merge "add_difference" &0 &3 alpha=&4'],
    ['merge "subtract" &0 &2', 'merge "subtract" &1 &2', 'merge "ties_sum" &3 &4 k=0.5',
     'merge "add_difference" &2 &5 alpha=1.0'],
    ['merge "subtract" &0 &2', 'merge "subtract" &1 &2',
     'merge "ties_sum_with_dropout" &3 &4 probability=0.3 seed=7', 'merge "add_difference" &2 &5'],
    ['merge "slerp" &0 &1 alpha=0.4'],
    ['merge "rotate" &0 &1 alignment=0.5 alpha=0.25'],
    ['merge "n_average" &0 &1 &2'],
    ['merge "subtract" &0 &2', 'merge "subtract" &1 &2', 'merge "model_stock" &3 &4',
     'merge "add_difference" &2 &5'],
    ['merge "crossover" &0 &1 alpha=0.3 tilt=0.5', 'merge "clamp" &3 &0 &1'],
    ['merge "subtract" &0 &1', 'merge "truncate_rank" &3 rank=2', 'merge "add_difference" &1 &4'],
    ['model "l.safetensors" merge_space="delta"', 'merge "add_difference" &0 &3 alpha=0.8'],
    ['model "l.safetensors" model_config="sd1-kohya_kohya_lora" merge_space="weight"',
     "merge \"convert_'sd1-kohya_kohya_lora'_to_base\" &3", "merge \"convert_'sd1-kohya'_to_'sd1-ldm'\" &4",
     "dict IN01=0.3 default=1", 'merge "add_difference" &0 &5 alpha=&6'],
]
ODD_VALUES = ["0", "1", "-1", "2", "0.5", "1e308", "-1e308", "1e-308", "1e999", "7", "-5", '"x"', "true",
              "null", "&0", "&99", "nan", "1.5e3"]
TOKENS = ["&0", "&1", "=", '"', "alpha=0.3", "dict", "k=1", "x", "3", "-", "#", "merge",
          'model "a.safetensors"']


@pytest.fixture(scope="module")
def cli():
    from patchbay_merge import cli
    from patchbay_merge import method_registry as registry

    methods = registry.all_methods()
    return cli, [m.name for m in methods], {m.name: m.param_names() for m in methods}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz")
    for index, name in enumerate("abc"):
        gen = torch.Generator().manual_seed(index)
        tensors = {k: torch.randn(s, generator=gen) for k, s in KEYS.items()}
        tensors[next(k for k in KEYS if k.endswith("position_ids"))] = torch.arange(5).reshape(1, 5)
        save_file(tensors, str(folder / f"{name}.safetensors"))
    gen = torch.Generator().manual_seed(9)
    lora = {}  # a kohya LoRA on two of the keys: a linear and a 3x3 convolution
    for module, up, down in (("input_blocks_1_1_transformer_blocks_0_attn2_to_k", (3, 2), (2, 768)),
                             ("down_blocks_0_resnets_0_conv1", (4, 2, 1, 1), (2, 3, 3, 3))):
        lora[f"lora_unet_{module}.lora_up.weight"] = torch.randn(up, generator=gen)
        lora[f"lora_unet_{module}.lora_down.weight"] = torch.randn(down, generator=gen)
        lora[f"lora_unet_{module}.alpha"] = torch.tensor(2.0)
    save_file(lora, str(folder / "l.safetensors"))
    return folder


def mutate(rng: random.Random, lines: list[str], methods: list[str], params: dict) -> list[str]:
    """One random edit of a recipe's instruction lines (the version header is kept)."""
    lines = list(lines)
    row = rng.randrange(len(lines))
    tokens = lines[row].split(" ")
    kind = rng.choice(("method", "value", "param", "token", "token", "line"))
    if kind == "method" and tokens[0] == "merge":
        tokens[1] = f'"{rng.choice(methods)}"'
    elif kind == "value" and (named := [i for i, t in enumerate(tokens) if "=" in t]):
        i = rng.choice(named)
        tokens[i] = tokens[i].split("=")[0] + "=" + rng.choice(ODD_VALUES)
    elif kind == "param" and tokens[0] == "merge" and params.get(tokens[1].strip('"')):
        tokens.append(f"{rng.choice(params[tokens[1].strip(chr(34))])}={rng.choice(ODD_VALUES)}")
    elif kind == "token":
        i = rng.randrange(len(tokens))
        edit = rng.choice(("delete", "duplicate", "insert", "swap"))
        if edit == "delete" and len(tokens) > 1:
            del tokens[i]
        elif edit == "duplicate":
            tokens.insert(i, tokens[i])
        elif edit == "insert":
            tokens.insert(i, rng.choice(TOKENS))
        else:
            j = rng.randrange(len(tokens))
            tokens[i], tokens[j] = tokens[j], tokens[i]
    else:
        other = rng.randrange(len(lines))
        edit = rng.choice(("delete", "duplicate", "swap"))
        if edit == "delete" and len(lines) > 1:
            del lines[row]
            return lines
        if edit == "duplicate":
            lines.insert(row, lines[row])
            return lines
        lines[row], lines[other] = lines[other], lines[row]
        return lines
    lines[row] = " ".join(tokens)
    return lines


def test_mutated_recipes_fail_cleanly_and_leave_nothing_behind(cli, folder, capsys):
    cli, methods, params = cli
    inputs = sorted(p.name for p in folder.iterdir())
    rng = random.Random(20)
    recipe, out = folder / "r.mecha", folder / "out.safetensors"
    outcomes = {"merged": 0, "refused": 0, "failed in merge": 0}
    for case in range(CASES):
        lines = mutate(rng, MODELS + rng.choice(RECIPES), methods, params)
        if rng.random() < 0.3:
            lines = mutate(rng, lines, methods, params)
        recipe.write_text("\n".join(["version 0.1.0", *lines]))
        validated = cli.main(["validate", str(recipe)])
        merged = cli.main(["merge", str(recipe), str(out), "--no-progress"])
        err = capsys.readouterr().err
        where = f"case {case}:\n" + "\n".join(lines) + f"\n{err}"
        assert validated in (0, cli.EXIT_USER_ERROR) and merged in (0, cli.EXIT_USER_ERROR), where
        assert "Traceback" not in err and "a bug in Patchbay" not in err, where
        if validated == 0 and merged != 0:  # what validate cannot know: a method's numbers on real tensors
            assert " failed: " in err or "inf or NaN" in err, where
            outcomes["failed in merge"] += 1
        else:
            assert merged == validated, where
            outcomes["merged" if merged == 0 else "refused"] += 1
        assert out.exists() == (merged == 0), where
        out.unlink(missing_ok=True)
        assert sorted(p.name for p in folder.iterdir()) == sorted([*inputs, "r.mecha"]), where
    assert outcomes["merged"] > CASES // 5 and outcomes["refused"] > CASES // 5, outcomes  # both reached
    # (a recipe that validates and then fails in a method is rare among these mutations; the
    # CLI tests pin those messages: slerp alpha=1e308, rotate centralization=-1e308)
