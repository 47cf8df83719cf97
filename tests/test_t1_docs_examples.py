"""T1: the Python examples in docs/node-authors.md run as written, and do what the text says."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.t1

DOC = Path(__file__).resolve().parent.parent / "docs" / "node-authors.md"
CKPT = "patchbay-sd15-tiny-a.safetensors"
ALIAS = "patchbay_docs"  # the examples' ``from ..patcher import x`` read as ``from patchbay_docs.patcher``


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_docs_examples_run(comfy, models, monkeypatch, capsys):
    n = comfy.nodes.NODE_CLASS_MAPPINGS
    pack = comfy.pack.__name__
    for sub in ("", ".patcher", ".patcher.model_patcher", ".patcher.registry", ".patcher.events",
                ".patcher.trace"):
        monkeypatch.setitem(sys.modules, ALIAS + sub, importlib.import_module(pack + sub))
    model, clip, _ = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    namespace = {"model": model}
    blocks = python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        exec(compile(block.replace("from ..patcher", f"from {ALIAS}.patcher"), str(DOC), "exec"), namespace)
    (positive,) = n["CLIPTextEncode"]().encode(clip, "a knight")
    (negative,) = n["CLIPTextEncode"]().encode(clip, "blurry")
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    for patcher in (namespace["mine"], namespace["traced"]):
        n["KSampler"]().sample(patcher, 1, 2, 1.0, "euler", "normal", positive, negative, latent)
    assert [(step, total) for step, total, _sigma in namespace["seen"]] == [(0, 2), (1, 2)]
    recorded = namespace["trace"].last_trace(namespace["traced"])
    assert recorded is not None and recorded.total_steps == 2
    assert "steps 0..1" in capsys.readouterr().out
