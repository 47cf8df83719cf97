"""Files the merge nodes read and write, all inside ComfyUI's folders, so a workflow someone shares cannot
make the nodes read or write anything else; a file by name in a ComfyUI folder with a did-you-mean
(``resolve``), which the LoRA nodes share (nodes/lora_files.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath

import folder_paths

from ..merge.names import nearest, suggestion

FOLDERS = {"checkpoints": "checkpoints", "diffusion_models": "diffusion_models", "unet": "diffusion_models",
           "loras": "loras"}
SEARCH_ORDER = ("checkpoints", "diffusion_models", "loras")
MODEL_EXTENSIONS = (".safetensors", ".sft")
RECIPES = "recipes"
IF_EXISTS = ("number", "error", "overwrite")


class UnknownFileError(ValueError):
    """A file name not found in its ComfyUI folder; the message lists the nearest names."""


def names(folder: str) -> list[str]:
    return folder_paths.get_filename_list(folder)


def resolve(name: str, folder: str = "loras") -> tuple[str, str]:
    """(file name as listed, full path) for ``name``; the extension and the subfolder may be left out.

    Raises UnknownFileError with the three nearest names in the folder.
    """
    names = folder_paths.get_filename_list(folder)
    wanted = name.strip().replace("\\", "/")
    if wanted in names:
        return wanted, folder_paths.get_full_path_or_raise(folder, wanted)
    stems = {PurePath(n).stem.lower(): n for n in names}
    stem = PurePath(wanted).stem.lower()
    if stem in stems:
        found = stems[stem]
        return found, folder_paths.get_full_path_or_raise(folder, found)
    near = nearest(stem, stems, cutoff=0.4)
    hint = suggestion([stems[n] for n in near]) if near else \
        f"the {folder} folder holds {len(names)} file(s); put the file there or fix the name."
    raise UnknownFileError(f"no {folder[:-1] if folder.endswith('s') else folder} named {name!r}; {hint}")


class MergePathError(ValueError):
    """A path a merge node will not read or write; the message names it and says what to write instead."""


def register_recipes_folder() -> None:
    """``models/recipes`` (``.mecha`` files) as a folder_paths folder, unless configured already."""
    if RECIPES not in folder_paths.folder_names_and_paths:
        folder_paths.folder_names_and_paths[RECIPES] = ([os.path.join(folder_paths.models_dir, RECIPES)],
                                                        {".mecha"})
    else:
        folder_paths.folder_names_and_paths[RECIPES][1].add(".mecha")


def model_path(folder: str, name: str) -> str:
    """The path a recipe stores for file ``name`` of ComfyUI folder ``folder``: ``folder/name``."""
    return f"{folder}/{name.replace(os.sep, '/')}"


def relative_parts(path: str, what: str) -> list[str]:
    """The ``/``-separated parts of a relative ``path``; absolute paths and ``..`` are refused."""
    text = path.strip().replace("\\", "/")
    if (not text or PurePosixPath(text).is_absolute() or PureWindowsPath(path.strip()).is_absolute()
            or re.match(r"^[A-Za-z]:", text) or text.startswith("~")):
        raise MergePathError(f"{what} {path!r}: absolute paths are not allowed in a graph (a shared workflow "
                             f"could read any file); name the file inside ComfyUI's folders, e.g. "
                             f"checkpoints/{PurePosixPath(text).name or 'model.safetensors'}")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise MergePathError(f"{what} {path!r}: '..' is not allowed; name the file inside its folder, "
                             f"e.g. checkpoints/{parts[-1]}")
    return parts


def model_file(path: str) -> Path:
    """The checked file a recipe's model ``path`` names (see the module docstring).

    A recipe names a model as ``<folder>/<name>`` (``checkpoints/a.safetensors``, ``diffusion_models/...``,
    ``loras/...``) or, as sd-mecha recipes often do, by its bare name (looked up in checkpoints, then
    diffusion_models, then loras). Refused, with the fix: absolute paths, ``..``, other folders, files
    that are not safetensors, names ComfyUI does not list, and files whose real path (symlinks resolved)
    lies outside that folder kind's configured folders. Outputs (``output_file``, ``lora_file``) are
    checked the same way before any folder is made.
    """
    parts = relative_parts(path, "model")
    if parts[0] in FOLDERS and len(parts) > 1:
        return _checked(FOLDERS[parts[0]], "/".join(parts[1:]), path)
    name = "/".join(parts)
    for folder in SEARCH_ORDER:
        if name in _listed(folder):
            return _checked(folder, name, path)
    if len(parts) > 1:  # a folder that is neither a model folder nor a subfolder of one: never ignored
        near = nearest(parts[0], FOLDERS, cutoff=0.5)
        fix = f"did you mean {near[0]}/{'/'.join(parts[1:])}?" if near else \
            f"write <folder>/<name>, e.g. checkpoints/{parts[-1]}"
        raise MergePathError(f"model {path!r}: not in {', '.join(SEARCH_ORDER)}: {parts[0]!r} is no model "
                             f"folder, and no {'/'.join(parts[:-1])} subfolder of one holds {parts[-1]}; "
                             f"{fix}")
    try:  # a near miss gets resolve's did-you-mean for the checkpoints folder
        resolve(name, "checkpoints")
    except UnknownFileError as error:
        raise MergePathError(f"model {path!r}: not in {', '.join(SEARCH_ORDER)} ({error}); write "
                             f"<folder>/<name>, e.g. checkpoints/{parts[-1]}") from None
    return _checked("checkpoints", name, path)


def _checked(folder: str, name: str, path: str) -> Path:
    if not name.lower().endswith(MODEL_EXTENSIONS):
        raise MergePathError(f"model {path!r}: only .safetensors files are read (loading a pickle .ckpt/.pt "
                             f"can run code); convert it once where you trust it, or use its .safetensors "
                             f"release")
    if "/" in name and name not in _listed(folder):  # a subfolder is never skipped over
        near = nearest(name, _listed(folder), cutoff=0.5)
        fix = suggestion(near) or f"no {name.rsplit('/', 1)[0]} subfolder of {folder} holds that file"
        raise MergePathError(f"model {path!r}: {folder} has no {name!r}; {fix}")
    try:
        found, full = resolve(name, folder)
    except UnknownFileError as error:
        raise MergePathError(f"model {path!r}: {error}") from None
    if not found.lower().endswith(MODEL_EXTENSIONS):
        raise MergePathError(f"model {path!r} is {found}: only .safetensors files are read; convert it")
    return inside(Path(full), folder_paths.get_folder_paths(folder), f"model {path!r}", folder)


def _listed(folder: str) -> set[str]:
    """The names ComfyUI lists in ``folder``, with ``/`` between subfolders on every system."""
    return {n.replace(os.sep, "/") for n in names(folder)}


def inside(file: Path, roots: list[str], what: str, folder: str) -> Path:
    """``file`` with symlinks resolved, if that lies inside one of ``roots`` (resolved too). ``file`` may
    not exist yet: its existing part is resolved and the rest (no ``..``) follows it."""
    real = Path(os.path.realpath(file))
    for root in roots:
        top = Path(os.path.realpath(root))
        if real == top or top in real.parents:
            return real
    raise MergePathError(f"{what}: {file} leads to {real}, outside the {folder} folders "
                         f"({', '.join(roots)}); move the file there, or add its folder to "
                         f"extra_model_paths.yaml")


def output_file(filename: str, if_exists: str) -> Path:
    """Where Save writes ``filename`` (``.safetensors`` added) under ComfyUI's output folder."""
    return _target(filename, folder_paths.get_output_directory(), "output", if_exists)


def lora_file(filename: str, if_exists: str) -> Path:
    """Where Extract LoRA writes ``filename`` (``.safetensors`` added): the first loras folder."""
    return _target(filename, folder_paths.get_folder_paths("loras")[0], "loras", if_exists)


def _target(filename: str, root: str, folder: str, if_exists: str) -> Path:
    if if_exists not in IF_EXISTS:
        raise MergePathError(f"if_exists {if_exists!r}: choose one of {', '.join(IF_EXISTS)}")
    parts = relative_parts(filename, "file name")
    if not parts[-1].lower().endswith(".safetensors"):
        parts[-1] += ".safetensors"
    target = Path(root, *parts)
    what = f"file name {filename!r}"
    inside(target.parent, [root], what, folder)  # first: the folders it would make must stay inside
    target.parent.mkdir(parents=True, exist_ok=True)
    inside(target.parent, [root], what, folder)  # and once they exist (a link made meanwhile)
    if target.exists() and if_exists == "number":
        stem = target.name.removesuffix(".safetensors")
        target = next(target.with_name(f"{stem}_{n:05}.safetensors") for n in range(1, 10**6)
                      if not target.with_name(f"{stem}_{n:05}.safetensors").exists())
    elif target.exists() and if_exists == "error":
        raise MergePathError(f"{target} exists; pick another file name, or set if_exists to 'number' (a new "
                             f"numbered name) or 'overwrite'")
    return target


def recipe_names() -> list[str]:
    return names(RECIPES)


def recipe_text(name: str) -> str:
    """The text of recipe file ``name`` of the recipes folder (UTF-8; a binary file is refused by name)."""
    relative_parts(name, "recipe file")
    try:
        _, full = resolve(name, RECIPES)
    except UnknownFileError as error:
        raise MergePathError(f"recipe file {name!r}: {error}") from None
    real = inside(Path(full), folder_paths.get_folder_paths(RECIPES), f"recipe file {name!r}", RECIPES)
    try:
        return real.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise MergePathError(f"recipe file {name!r} ({real}): not a text file (byte {error.start} is not "
                             f"UTF-8); a recipe is .mecha text starting with 'version 0.1.0'") from None
