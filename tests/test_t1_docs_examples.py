"""T1: the Python examples in docs/node-authors.md run as written, and do what the text says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.t1

DOC = Path(__file__).resolve().parent.parent / "docs" / "node-authors.md"
CKPT = "patchbay-sd15-tiny-a.safetensors"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_docs_examples_run(comfy, models, capsys):
    n = comfy.nodes.NODE_CLASS_MAPPINGS
    model, clip, _ = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    # The examples are code of a nodes/ module (``from ..patcher import x``): run as one of the loaded
    # pack's, their imports find its patcher under the one name it has (devtools/pack_imports.py).
    package = comfy.pack.__name__ + ".nodes"
    namespace = {"model": model, "__name__": package + ".docs_example", "__package__": package}
    blocks = python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    (positive,) = n["CLIPTextEncode"]().encode(clip, "a knight")
    (negative,) = n["CLIPTextEncode"]().encode(clip, "blurry")
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    for patcher in (namespace["mine"], namespace["traced"]):
        n["KSampler"]().sample(patcher, 1, 2, 1.0, "euler", "normal", positive, negative, latent)
    assert [(step, total) for step, total, _sigma in namespace["seen"]] == [(0, 2), (1, 2)]
    recorded = namespace["trace"].last_trace(namespace["traced"])
    assert recorded is not None and recorded.total_steps == 2
    assert "steps 0..1" in capsys.readouterr().out
