"""Which block and which component a state-dict key belongs to, and per-block literal resolution, so a
recipe's block maps (``IN00=0, OUT*=1``) mean the same on every family.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable, Mapping

from . import architectures as archs
from .names import nearest, suggestion

ARCHS = tuple(archs.BY_ID)  # every family of the table, in its order: the nodes' architecture menus
_RANGE = re.compile(r"(?P<stem>.*?\D)(?P<first>\d+)-(?P=stem)?(?P<last>\d+)")
MAX_RANGE = 1000  # blocks one range entry may name
_UNET = re.compile(r"(?:^|\.)(input_blocks|middle_block|output_blocks)\.(\d+)\.")
_UNET_TAIL = {"sd15": "OUT11", "sd2": "OUT11", "sdxl": "OUT08"}
_DIFFUSION = archs.DIFFUSION_PREFIX


def block_names(arch: str, keys: Iterable[str] | None = None) -> tuple[str, ...]:
    """Every block name of ``arch`` in model order (empty for an unknown architecture): counted from
    ``keys`` (canonical or diffusion-model-only) when given, else the family's reference release.

    Every family of the table in merge/architectures.py has block names. The UNet families follow
    sd-mecha's supermerger block configs: SD1.5 and SD2 have 26 (``BASE``, ``IN00``..``IN11``, ``M00``,
    ``OUT00``..``OUT11``), SDXL 20 (``BASE``, ``IN00``..``IN08``, ``M00``, ``OUT00``..``OUT08``) plus ``VAE``.
    The others are named after their modules: indexed blocks as in the keys (Flux ``double_blocks.N``,
    ``single_blocks.N``, Wan ``blocks.N``, Qwen-Image ``transformer_blocks.N``, ...), counted from the file
    when its keys are at hand (Flux.1 [dev] 19 + 38, Flux.2 [dev] 8 + 48), every other top-level module
    of the diffusion model by its name (``img_in``, ``final_layer``, ``head``, ...), and ``BASE`` (text
    encoders) / ``VAE`` outside it. Without a file, a family's reference release gives the counts (the
    block-weight nodes' widgets). Keys may carry ComfyUI's ``model.diffusion_model.`` prefix or not
    (diffusion-model-only files).
    """
    family = archs.BY_ID.get(arch)
    if family is None:
        return ()
    if family.unet:
        count = dict(family.groups)["input_blocks.{n}"]
        vae = ("VAE",) if arch == "sdxl" else ()
        return ("BASE", *_numbered("IN", count), "M00", *_numbered("OUT", count), *vae)
    if keys is None:
        counts, modules = family.groups, [*family.head, *family.tail]
    else:
        keys = list(keys)
        counts, modules = archs.layout_of(arch, keys), _modules(family, keys)
    head = [m for m in modules if m not in family.tail]
    indexed = [template.replace("{n}", str(i)) for template, n in counts for i in range(n)]
    return ("BASE", *head, *indexed, *[m for m in family.tail if m in modules], "VAE")


def _modules(family: archs.Family, keys: list[str]) -> list[str]:
    """The top-level modules of the diffusion model in ``keys`` that are no indexed block: the
    family's known ones in table order, then the others by name."""
    found = set()
    for key in keys:
        body = archs.body_of(key)
        if body is not None and archs.group_block(family, body) is None:
            found.add(body.split(".", 1)[0])
    known = [m for m in (*family.head, *family.tail) if m in found]
    return known + sorted(found - set(known))


def block_of(arch: str, key: str) -> str | None:
    """The block ``key`` belongs to in ``arch`` (a family id); None for an unknown arch."""
    family = archs.BY_ID.get(arch)
    if family is None:
        return None
    return _unet_block(arch, key) if family.unet else _module_block(family, key)


def _unet_block(arch: str, key: str) -> str:
    if key.startswith("first_stage_model."):
        return "VAE" if arch == "sdxl" else "BASE"
    if key.startswith(("cond_stage_model.", "conditioner.", "model_ema.")):
        return "BASE"
    if m := _UNET.search(key):
        kind, index = m.group(1), int(m.group(2))
        return {"input_blocks": f"IN{index:02}", "middle_block": "M00"}.get(kind, f"OUT{index:02}")
    body = key.removeprefix(_DIFFUSION)
    if body.startswith(("time_embed.", "label_emb.")):
        return "BASE"
    if key.startswith(_DIFFUSION) or body.startswith("out."):
        return _UNET_TAIL[arch]
    return "BASE"


def _module_block(family: archs.Family, key: str) -> str:
    if key.startswith(("vae.", "first_stage_model.")):
        return "VAE"
    body = archs.body_of(key)
    if body is None:
        return "BASE"
    if (found := archs.group_block(family, body)) is not None:
        return found[0].replace("{n}", str(found[1]))
    return body.split(".", 1)[0]


COMPONENTS = {f.id: ("diffuser", *dict.fromkeys(c for _, c in f.components),
                     *(("scheduler",) if f.unet and f.id != "sdxl" else ()))
              for f in archs.FAMILIES}
COMPONENTS["sdxl"] = ("diffuser", "clip_l", "clip_g", "vae", "scheduler")


def component_of(arch: str, key: str) -> str | None:
    """sd-mecha's component of ``key``: diffuser, clip_l, clip_g, vae, ema, scheduler (UNet families),
    text_encoder (the other families but Flux.1, whose encoders are ``clip_l`` as in sd-mecha)."""
    if key.startswith(_DIFFUSION):
        return "diffuser"
    family = archs.BY_ID.get(arch)
    if family is None:
        return None
    for prefix, component in family.components:
        if key.startswith(prefix):
            return component
    if not family.unet:
        return "diffuser"  # a diffusion-model-only file has no prefix
    if arch == "sdxl" and key.split(".", 1)[0] in ("v_pred", "ztsnr", "edm_vpred"):
        return "diffuser"
    return "scheduler"


def resolve(mapping: Mapping[str, object], arch: str, key: str, *, where: str = "literal") -> object:
    """The value a per-block / per-key map gives ``key``: exact key, then block name, then the
    first fnmatch glob (in the map's order) matching the key or its block name (``OUT*``,
    ``single_blocks.*``), then ``default``.

    Raises ``KeyError`` naming the key, its block and the map's entries when nothing matches.
    """
    if key in mapping:
        return mapping[key]
    block = block_of(arch, key)
    if block is not None and block in mapping:
        return mapping[block]
    for pattern, value in mapping.items():
        if pattern == "default" or not _is_glob(pattern):
            continue
        if fnmatch.fnmatchcase(key, pattern) or (block is not None and fnmatch.fnmatchcase(block, pattern)):
            return value
    if "default" in mapping:
        return mapping["default"]
    raise KeyError(f"{where}: no entry for key {key!r} (block {block!r} in {arch}) among "
                   f"{', '.join(mapping) or 'no entries'}; add it or a 'default' entry")


def expand_ranges(mapping: Mapping[str, object]) -> dict[str, object]:
    """``mapping`` with each range entry written out, in place of it: ``double_blocks.0-7`` ->
    ``double_blocks.0`` .. ``double_blocks.7``, ``IN00-05`` (or ``IN00-IN05``) -> ``IN00`` .. ``IN05``
    (numbers as wide as the first one's). A later entry for the same block wins, as in any map. Globs
    and other names pass unchanged; whether the blocks exist is ``check_map``'s question.

    Raises ``ValueError`` naming a range that runs backwards or names more than ``MAX_RANGE`` blocks.
    """
    out: dict[str, object] = {}
    for entry, value in mapping.items():
        match = _RANGE.fullmatch(entry) if isinstance(entry, str) and not _is_glob(entry) else None
        if match is None:
            out[entry] = value
            continue
        first, last = int(match["first"]), int(match["last"])
        if not 0 <= last - first < MAX_RANGE:
            raise ValueError(f"block range {entry!r} runs from {first} to {last}: write the lower number "
                             f"first, at most {MAX_RANGE} blocks (e.g. {match['stem']}{match['first']}-"
                             f"{first + 7})")
        width = len(match["first"]) if match["first"].startswith("0") else 1
        for index in range(first, last + 1):
            out[f"{match['stem']}{index:0{width}}"] = value
    return out


def check_map(mapping: Mapping[str, object], arch: str, keys: Collection[str] | None = None) -> None:
    """Refuse map entries that can match nothing: not ``default``, not a glob, not a block name of
    ``arch`` and not one of ``keys`` (when given, block names are counted from them; without it an
    indexed block of one of the family's groups passes whatever its number, and any other dotted name
    that does not look like an indexed block passes as a key).

    Raises ``ValueError`` naming the entry, with the nearest block names.
    """
    names = block_names(arch, keys)
    for entry in mapping:
        if entry == "default" or _is_glob(entry) or entry in names:
            continue
        if (entry in keys) if keys is not None else _may_be_key_or_block(entry, arch):
            continue
        if not names:
            raise ValueError(f"map entry {entry!r} is no key and no glob, and block names need a known "
                             f"architecture (these models are {arch}: no family of merge/architectures.py "
                             f"matches them): use key globs")
        close = nearest_blocks(entry, names)
        hint = f"; {suggestion(close)}" if close else ""
        if archs.BY_ID[arch].unet:
            shown = f"{', '.join(names[:4])}, ..."
        else:
            shown = f"{'counted from the file: ' if keys is not None else ''}{_span(names)}"
        raise ValueError(f"map entry {entry!r} is no block of {arch} ({shown}), no key and no glob{hint}")


def _may_be_key_or_block(entry: str, arch: str) -> bool:
    """Without a file: ``entry`` is an indexed block of one of ``arch``'s groups (counted once the file
    is known), or a dotted name that is no indexed block (a key)."""
    if "." not in entry:
        return False
    family = archs.BY_ID.get(arch)
    indexed = re.fullmatch(r"(.*\D)\d+", entry)
    if family is None or family.unet or indexed is None:
        return True
    return any(template.replace("{n}", "") == indexed[1] for template, _ in family.groups)


def _span(names: tuple[str, ...]) -> str:
    """``BASE, img_in, double_blocks.0-7, single_blocks.0-47, final_layer, VAE``: runs of indexed names
    shortened."""
    out: list[str] = []
    run: list = []  # stem, first and last index of the run out[-1] shows
    for name in names:
        stem, _, index = name.rpartition(".")
        if index.isdigit() and run and run[0] == stem and int(index) == run[2] + 1:
            run[2] = int(index)
            out[-1] = f"{stem}.{run[1]}-{run[2]}"
        else:
            run = [stem, int(index), int(index)] if stem and index.isdigit() else []
            out.append(name)
    return ", ".join(out)


def nearest_blocks(entry: str, names: tuple[str, ...]) -> list[str]:
    """Up to three block names close to a misspelt ``entry``; a name that differs only in case or in
    the padding of its number (``in0``, ``IN0`` -> ``IN00``) comes first."""
    first = []
    if match := re.fullmatch(r"([A-Za-z]+)(\d+)", entry):
        padded = f"{match[1].upper()}{int(match[2]):02}"
        first = [padded] if padded in names else []
    close = nearest(entry.upper() if entry.isalnum() else entry, names, cutoff=0.5)
    return (first + [c for c in close if c not in first])[:3]


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _numbered(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02}" for i in range(count))
