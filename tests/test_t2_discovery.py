"""T2: what a user finds the pack by, as the live server (the session's ``comfy_server``) serves it:
node search words, help pages where the frontend asks first, and the template browser's cards.

The frontend's own rules, read in its source (1.32.9 with ComfyUI 0.3.75, 1.49.6 with 0.33, and
1.58.1) and restated here so that a test can hold the pack to them without a browser:
- help: NodeHelpService.fetchCustomNodeHelp asks for ``/extensions/<pack>/docs/<NodeId>/<locale>.md``,
  then ``docs/<NodeId>.md``;
- template browser: a pack's card is its file name (title, description, search text), see
  devtools/workflow_catalog.py;
- node search: NodeSearchService matches ``name``, ``display_name`` and (1.49.6 on) ``search_aliases``,
  then FuseSearch ``calcAuxSingle`` ranks by ``name`` and ``display_name`` only (``rank_key`` below),
  a node's usage frequency next (core nodes have one, Patchbay's none: a tie goes to core).
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import devpaths
import pytest
from workflow_catalog import CATALOG, SEARCH_REACH, TITLE_LENGTH

SAFE_NAME = re.compile(r"[A-Za-z0-9 .,()-]+")  # no URL specials (the frontend does not encode names)

pytestmark = pytest.mark.t2

PACK_MODULE = f"custom_nodes.{devpaths.PACK_NAME}"

# query -> the Patchbay nodes it must find; the first of them must be the search's first result where
# "first" is True (where a core node's name matches as well as ours, core's usage frequency wins, and
# no alias can change that: the frontend ranks by name and display name only).
SEARCHES = {
    "lora schedule": (True, {"PatchbayScheduledLora"},
                      {"PatchbayHookKeyframesFromFloats", "PatchbayHookKeyframesFromText",
                       "PatchbayFloatsRamp", "PatchbayFloatsFromText", "PatchbayHookKeyframesInterpolated"}),
    "regional lora": (True, {"PatchbayRegionalLora"}, set()),
    "block weight": (True, {"PatchbayHookBlockWeights", "PatchbayMergeBlockWeightsSD15",
                            "PatchbayMergeBlockWeightsSDXL", "PatchbayMergeBlockWeightsFlux"}, set()),
    "merge": (False, {"PatchbayMerge"}, {"PatchbayRecipeHook"}),
    "keyframe": (False, {"PatchbayHookKeyframe", "PatchbayHookKeyframesFromFloats"},
                 {"PatchbayHookKeyframesFromText", "PatchbayHookKeyframesInterpolated"}),
}


def _words(text: str) -> list[str]:
    return [w.lower() for w in re.split(r" |\b|(?<=[a-z])(?=[A-Z])|(?=[A-Z][a-z])", text)]


def rank_key(query: str, text: str) -> tuple:
    """FuseSearch.calcAuxSingle: 0 equal, 1 prefix, 2 a whole word, 3 a substring, 4 every query word a
    word, 5 every query word a substring, 9 none of these (found by Fuse alone); then position, length."""
    words, parts, low = _words(text), query.split(" "), text.lower()
    if low == query:
        return (0, 0.0, 0)
    if low.startswith(query):
        return (1, 0.0, len(low))
    if query in words or query in low:
        return (2 if query in words else 3, low.index(query) + len(low) * 0.5, len(low))
    for tier, where in ((4, words), (5, None)):
        if all(p in (where if where is not None else low) for p in parts):
            start = min(low.index(p) for p in parts)
            end = max(low.index(p) + len(p) for p in parts)
            return (tier, end - start + end * 0.5 + len(low) * 0.5, len(low))
    return (9, 0.0, 0)


def search(object_info: dict, query: str) -> list[str]:
    """The node ids the frontend lists for ``query``, best first (exact-substring matching: Fuse's fuzzy
    matches would only add results ranked 9)."""
    query = query.lower()
    found = []
    for node_id, info in object_info.items():
        names = (node_id, info.get("display_name") or node_id)
        best = min(rank_key(query, name) for name in names)
        texts = [t.lower() for t in (*names, *(info.get("search_aliases") or []))]
        if best[0] < 9 or any(all(p in t for p in query.split(" ")) for t in texts):
            frequency = 0 if info.get("python_module") == PACK_MODULE else 1
            found.append(((best[0], -frequency, *best[1:]), node_id))
    return [node_id for _, node_id in sorted(found)]


def pack_nodes(object_info: dict) -> dict[str, dict]:
    return {node: info for node, info in object_info.items() if info.get("python_module") == PACK_MODULE}


def aliases_served(object_info: dict) -> bool:
    return any("search_aliases" in info for info in object_info.values())


def test_search_aliases_reach_the_frontend_where_comfyui_sends_them(object_info):
    ours = pack_nodes(object_info)
    if devpaths.comfyui_version() == "0.3.75":  # its node_info has no search_aliases field
        assert not aliases_served(object_info)
        return
    missing = sorted(node_id for node_id, info in ours.items() if not info.get("search_aliases"))
    assert not missing, f"served without search_aliases: {missing}"


@pytest.mark.parametrize("query", SEARCHES)
def test_node_search_finds_the_right_patchbay_nodes_first(object_info, query):
    first_overall, first, by_alias = SEARCHES[query]
    results = search(object_info, query)
    ours = [node_id for node_id in results if node_id.startswith("Patchbay")]
    assert ours and ours[0] in first, f"{query!r}: Patchbay's first result is {ours[:3]}, want one of {first}"
    if first_overall:
        assert results[0] in first, f"{query!r}: the first results are {results[:5]}"
    if aliases_served(object_info):
        assert by_alias <= set(ours), f"{query!r} does not find {sorted(by_alias - set(ours))}"


# px: the most a help diagram is drawn at (about a side panel's width, not measured); where the panel is
# narrower, the frontend's .comfy-markdown-content img {max-width: 100%} scales it down (1.32.9 on)
HELP_PANEL_WIDTH = 360
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def test_help_pages_are_where_the_frontend_asks_first(comfy_server, object_info):
    """Every node's page answers the first request (locale en), and the fallback answers the others; a
    diagram (linked relative to docs/, where the frontend resolves it) is served and fits the panel."""
    base = f"{comfy_server.url}/extensions/{devpaths.PACK_NAME}/docs"
    ours = sorted(pack_nodes(object_info))
    for node_id in ours:
        for path in (f"{node_id}/en.md", f"{node_id}.md"):
            with urllib.request.urlopen(f"{base}/{path}", timeout=30) as response:
                text = response.read().decode()
                assert response.status == 200 and text.startswith("# "), path
        for image in IMAGE_LINK.findall(text):
            with urllib.request.urlopen(f"{base}/{image}", timeout=30) as response:
                assert response.headers["Content-Type"] == "image/svg+xml", image
                width = re.search(rb'<svg[^>]*\swidth="(\d+)"', response.read())
                assert width and int(width.group(1)) <= HELP_PANEL_WIDTH, f"{image} is wider than the panel"
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"{base}/{ours[0]}/de.md", timeout=30)


def template_search_finds(name: str, query: str) -> bool:
    """The template browser's search (Fuse, threshold 0.4, location 0, distance 100) finds an exact
    occurrence of ``query`` only where it starts within the first SEARCH_REACH characters."""
    at = name.lower().find(query.lower())
    return 0 <= at <= SEARCH_REACH


def test_template_cards_say_what_each_workflow_does(comfy_server):
    """The names the server lists (title, description and search text of each card) are the catalogue's;
    each is found by "Patchbay", its category and its subjects, and its thumbnail is the one served."""
    listed = sorted(comfy_server.get_json("/api/workflow_templates").get(devpaths.PACK_NAME) or [])
    assert listed == sorted(entry.file_name for entry in CATALOG.values())
    for slug, entry in CATALOG.items():
        name = entry.file_name
        assert SAFE_NAME.fullmatch(name) and len(entry.title) <= TITLE_LENGTH, name
        for query in ("Patchbay", entry.category, *entry.subjects):
            assert template_search_finds(name, query), f"searching {query!r} does not find {name!r} ({slug})"
        assert (devpaths.WORKFLOWS_DIR / f"{name}.jpg").is_file(), f"{name}.jpg"
