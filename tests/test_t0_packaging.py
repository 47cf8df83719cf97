"""T0: the registry metadata in pyproject.toml is complete and points at files that exist in the repo."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_tool_comfy_has_every_registry_field():
    comfy = PYPROJECT["tool"]["comfy"]
    for field in ("PublisherId", "DisplayName", "Icon", "requires-comfyui"):
        assert isinstance(comfy.get(field), str) and comfy[field].strip(), f"[tool.comfy] {field} is empty"
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"]), comfy["requires-comfyui"]


def test_icon_url_is_this_repos_raw_file_and_a_square_svg():
    repository = PYPROJECT["project"]["urls"]["Repository"]
    owner_name = repository.removeprefix("https://github.com/")
    icon = PYPROJECT["tool"]["comfy"]["Icon"]
    prefix = f"https://raw.githubusercontent.com/{owner_name}/main/"
    assert icon.startswith(prefix), f"Icon {icon!r} is not a raw URL of {repository} on main"
    path = ROOT / icon.removeprefix(prefix)
    assert path.is_file(), f"Icon points at {path.relative_to(ROOT)}, which is not in the repo"
    svg = ET.parse(path).getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    width, height = svg.get("width"), svg.get("height")
    assert width == height and int(width) <= 400, f"the registry wants a square icon, not {width}x{height}"


def test_readme_registry_install_line_names_the_project():
    readme = (ROOT / "README.md").read_text()
    assert f"comfy node install {PYPROJECT['project']['name']}" in readme


def test_no_tracked_text_file_holds_a_merge_conflict_marker():
    """A merge once committed README.md with its conflict markers; nothing else caught it."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    marker = re.compile(rb"^(<{7}|>{7}) |^={7}$", re.M)
    found = []
    for name in tracked.decode().split("\0"):
        path = ROOT / name
        if not name or path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images, models)
        newline = b"\n"
        found += [f"{name}:{data.count(newline, 0, m.start()) + 1}" for m in marker.finditer(data)]
    assert not found, "conflict markers left in: " + ", ".join(found)
