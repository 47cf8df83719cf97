"""T2: a live ComfyUI server (one per session) loads the pack and runs every bundled workflow.

The server is ComfyUI (0.3.75 or 0.33, whichever PATCHBAY_COMFYUI holds) started as a user would
(``main.py --cpu``) with this repo linked in as ``custom_nodes/ComfyUI-Patchbay`` (fixture
``comfy_server`` in conftest.py). Workflows are the UI-format files in ``workflows/``, converted by
devtools/workflow_api.py (with the rules of the frontend the server serves) and queued over HTTP.
"""

from __future__ import annotations

import ast
import json
import re
import urllib.request
from pathlib import Path
from urllib.parse import quote

import devpaths
import pytest
from comfy_server import ExecutionError
from stand_ins import replace_text_encoders
from workflow_api import workflow_to_prompt

pytestmark = pytest.mark.t2

WORKFLOWS = sorted(devpaths.WORKFLOWS_DIR.glob("*.json"))
# The merging workflows run on the first ComfyUI version only (marked once): their merges are ComfyUI-free
# (merge/, checked against sd-mecha in t0), and what they call of ComfyUI is checked on every version
# elsewhere: the Merge node's model build, sampling and Save Merge through this server by
# tests/test_t2_merge.py (which also checks the key-patterns and SDXL block-weight workflows' files
# tensor by tensor on every version), the grid, Extract LoRA, LoRA stacks and method nodes in-process by
# tests/test_t1_merge_*.py and test_t1_lora_stack.py, and each file (its widgets and links, as each
# version's frontend reads them) by test_t3_frontend.py. Together they take about 45 s per version (the
# 3x3 grid alone merges and samples nine times). "Merge as a hook" samples with hooks: every version.
MERGE_CATEGORY = " - Patchbay Merging"
EVERY_VERSION = {"Merge as a hook, fading in - Patchbay Merging"}
ONCE_WORKFLOWS = {p.stem for p in WORKFLOWS
                  if p.stem.endswith(MERGE_CATEGORY) and p.stem not in EVERY_VERSION}
PACK_MODULE = f"custom_nodes.{devpaths.PACK_NAME}"
# ComfyUI 0.3.75's own audio nodes need torchaudio, which its environment leaves out on purpose (0.33
# imports torchaudio at startup, so its environment has it and every core node module imports).
KNOWN_IMPORT_FAILURES = {"0.3.75": {"nodes_audio.py", "nodes_audio_encoder.py"}}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Sampler steps a bundled workflow runs with here: its own (8 or 10) cost a 256x128 regional workflow
# 25 s a version on the CPU; every node still runs, only the sampler loops fewer times.
STEPS_AT_MOST = 3
SAMPLERS = ("KSampler", "PatchbayMergeGrid")  # nodes with a plain ``steps`` input (KSamplerAdvanced's
# two-stage step ranges are left as they are)
NO_SAMPLER = {"Hook schedule preview - Patchbay Schedules", "SDXL LoRA merged per block - Patchbay Merging",
              "Wan 2.2, LoRA on high noise - Patchbay Hooks"}


def declared_nodes() -> dict[str, str]:
    """``{NODE_ID: DISPLAY_NAME}`` of every node class declared in nodes/*.py (read, not imported), and
    of one node per registered merge method (nodes/merge_methods.py generates those classes)."""
    import build_merge_docs
    from patchbay_merge import method_registry as registry

    declared = {build_merge_docs.node_id(method.name): f"{method.name} (Patchbay merge)"
                for method in registry.all_methods()}
    for path in sorted((devpaths.ROOT / "nodes").glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef):
                attrs = {t.id: s.value.value for s in cls.body if isinstance(s, ast.Assign)
                         for t in s.targets if isinstance(t, ast.Name) and isinstance(s.value, ast.Constant)}
                if "NODE_ID" in attrs:
                    declared[attrs["NODE_ID"]] = attrs.get("DISPLAY_NAME")
    return declared


def test_every_pack_node_is_served(object_info):
    ours = {name: info for name, info in object_info.items() if info.get("python_module") == PACK_MODULE}
    declared = declared_nodes()
    assert declared, "no node class with a NODE_ID in nodes/*.py"
    assert all(node_id.startswith("Patchbay") for node_id in declared), sorted(declared)
    assert sorted(ours) == sorted(declared), "nodes declared in nodes/*.py and nodes served differ"
    for node_id, display_name in declared.items():
        assert ours[node_id]["display_name"] == display_name


def test_server_log_has_no_import_failure_of_ours(comfy_server):
    log = comfy_server.startup_log()  # plain_log's lines: 0.33's [INFO] tags removed
    known = KNOWN_IMPORT_FAILURES.get(devpaths.comfyui_version(), set())
    failed = set(re.findall(r"^IMPORT FAILED: (\S+)", log, re.MULTILINE))
    assert failed == known, f"import failures {sorted(failed)}, expected {sorted(known)}"
    cannot = re.findall(r"^Cannot import (\S+) module", log, re.MULTILINE)
    assert sorted(path.rsplit("/", 1)[-1] for path in cannot) == sorted(known), cannot
    marks = (f"custom_nodes/{devpaths.PACK_NAME}", f'File "{devpaths.ROOT}/')
    ours = [line for line in log.splitlines() if any(mark in line for mark in marks)]
    timing = [line for line in ours if re.match(r"\s*[\d.]+ seconds", line)]
    assert len(timing) == 1 and "IMPORT FAILED" not in timing[0], f"pack import line: {timing}"
    unexpected = [line for line in ours if line not in timing]
    assert not unexpected, "the log mentions the pack:\n" + "\n".join(unexpected)


def test_template_browser_lists_the_bundled_workflows(comfy_server):
    listed = comfy_server.get_json("/api/workflow_templates").get(devpaths.PACK_NAME)
    assert sorted(listed or []) == sorted(path.stem for path in WORKFLOWS)
    for path in WORKFLOWS:
        base = f"{comfy_server.url}/api/workflow_templates/{devpaths.PACK_NAME}/{quote(path.stem)}"
        with urllib.request.urlopen(base + ".json", timeout=30) as response:
            assert json.loads(response.read()) == json.loads(path.read_text())
        with urllib.request.urlopen(base + ".jpg", timeout=30) as response:
            assert response.headers["Content-Type"] == "image/jpeg"
            assert response.read(3) == b"\xff\xd8\xff", f"{path.stem}.jpg is not a JPEG"


def fewer_steps(prompt: dict) -> int:
    """Cap the ``steps`` of the prompt's samplers at STEPS_AT_MOST; how many samplers it found."""
    found = 0
    for node in prompt.values():
        steps = node["inputs"].get("steps")
        if node["class_type"] in SAMPLERS and isinstance(steps, int):
            node["inputs"]["steps"] = min(steps, STEPS_AT_MOST)
            found += 1
    return found


def saved_merges(comfy_server, prompt: dict, entry: dict) -> list[Path]:
    """The files the Save Merge nodes of ``prompt`` wrote: each node's text names its file, which lies in
    the folder of its ``filename`` under the output folder."""
    return [comfy_server.output_dir / Path(node["inputs"]["filename"]).parent
            / entry["outputs"][nid]["text"][0].split(":")[0]
            for nid, node in prompt.items() if node["class_type"] == "PatchbayMergeSave"]


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.once) if p.stem in ONCE_WORKFLOWS else p
                                  for p in WORKFLOWS], ids=lambda p: p.stem)
def test_bundled_workflow_runs_and_writes_its_images_or_merges(comfy_server, object_info, frontend_version,
                                                                path):
    """A workflow saves images (PNG, not one flat colour) or merged checkpoints (safetensors with keys);
    a merge of UNet-only files (SDXL, Flux here: no text encoder to sample with) saves only the file.
    Samplers run at most STEPS_AT_MOST steps."""
    from PIL import Image
    from safetensors import safe_open

    prompt = workflow_to_prompt(json.loads(path.read_text()), object_info, frontend=frontend_version)
    prompt = replace_text_encoders(prompt)  # umT5-XXL cannot be tiny: devtools/stand_ins.py
    assert fewer_steps(prompt) or path.stem in NO_SAMPLER, f"{path.stem}: no sampler with steps found"
    entry = comfy_server.wait(comfy_server.queue(prompt))
    images, merges = comfy_server.output_files(entry), saved_merges(comfy_server, prompt, entry)
    assert images or merges, f"{path.stem} saved no image and no merge"
    for image_path in images:
        assert image_path.read_bytes()[:8] == PNG_SIGNATURE, f"{image_path} is not a PNG"
        with Image.open(image_path) as image:
            extrema = image.convert("RGB").getextrema()
        assert any(low != high for low, high in extrema), f"{image_path} is a single colour {extrema}"
    for merge_path in merges:
        with safe_open(str(merge_path), "pt") as handle:
            assert list(handle.keys()) and "patchbay.recipe" in handle.metadata(), merge_path


def test_the_workflows_run_once_are_bundled():
    stems = {path.stem for path in WORKFLOWS}
    assert not EVERY_VERSION - stems, f"not bundled (renamed?): {sorted(EVERY_VERSION - stems)}"
    assert len(ONCE_WORKFLOWS) >= 10, sorted(ONCE_WORKFLOWS)  # the merging category, found by its title


def test_execution_error_carries_comfyui_message(comfy_server):
    prompt = {"1": {"class_type": "PatchbayFloatsFromText", "inputs": {"text": "1, 0"}},
              "2": {"class_type": "PatchbayHookKeyframesFromFloats",
                    "inputs": {"floats": ["1", 0], "start_percent": 0.8, "end_percent": 0.2}},
              "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}
    with pytest.raises(ExecutionError, match=r"node 2 \(PatchbayHookKeyframesFromFloats\).*swap them"):
        comfy_server.wait(comfy_server.queue(prompt))
    result = comfy_server.run(prompt)
    assert not result.ok and "end_percent 0.2 is before start_percent 0.8" in result.error


def test_floats_text_error_stops_the_prompt_before_it_runs(comfy_server):
    """A typo in FLOATS text is refused when the prompt is queued (VALIDATE_INPUTS), naming the column."""
    prompt = {"1": {"class_type": "PatchbayFloatsFromText", "inputs": {"text": "0, half, 1"}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    with pytest.raises(ExecutionError, match=r"refused the prompt(.|\n)*node 1 \(PatchbayFloatsFromText\)"
                                             r".*'half' at line 1, column 4"):
        comfy_server.queue(prompt)


def test_validation_error_names_node_and_input(comfy_server):
    prompt = {"1": {"class_type": "PatchbayFloatsRamp",
                    "inputs": {"start": 0.0, "end": 1.0, "count": 0, "easing": "linear"}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    result = comfy_server.run(prompt)
    assert not result.ok
    assert "node 1 (PatchbayFloatsRamp)" in result.error and "count" in result.error
