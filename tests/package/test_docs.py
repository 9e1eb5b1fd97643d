"""The docs speak to users and hold together: every shipped preset is in docs/training.md,
no internal jargon (design-contract numbers, "the issue"), every relative link and anchor
resolves, and the package is described as image and video with four algorithms."""

from __future__ import annotations

import re
from pathlib import Path

from flowgrpo.algorithms import ALGORITHMS
from flowgrpo.config.loader import list_presets

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
JARGON = re.compile(r"contract \d|\bthe issue\b|issue's|\(DESIGN\)|DESIGN\.md", re.I)
LINK = re.compile(r"\]\(([^)\s]+?\.md)(#[^)\s]*)?\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_training_doc_lists_every_preset():
    text = (ROOT / "docs" / "training.md").read_text()
    presets_section = text.split("## Presets", 1)[1].split("\n## ", 1)[0]
    for name in list_presets():
        assert f"| {name} " in presets_section or f"| {name} |" in presets_section, name
        assert f"`{name}`" in text.split("## Presets", 1)[0], name  # in the preset list too


def test_docs_have_no_internal_jargon():
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not JARGON.search(line), f"{path.name}:{n}: {line.strip()}"


def test_every_relative_doc_link_and_anchor_resolves():
    for path in DOCS:
        for target, anchor in LINK.findall(path.read_text()):
            if "://" in target:
                continue
            dest = (path.parent / target).resolve()
            assert dest.is_file(), f"{path.name} links to missing {target}"
            if anchor:
                headings = [
                    _slug(h.lstrip("#")) for h in dest.read_text().splitlines() if h.startswith("#")
                ]
                assert anchor[1:] in headings, f"{path.name} links to missing {target}{anchor}"


def test_the_package_is_described_as_image_and_video_with_four_algorithms():
    tomllib = __import__("pytest").importorskip("tomllib")
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    intro = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    names = {"flow_grpo": "Flow-GRPO", "mix_grpo": "MixGRPO", "grpo_guard": "GRPO-Guard"}
    names["nft"] = "DiffusionNFT"
    names["awm"] = "Advantage Weighted Matching"
    names["flow_dppo"] = "Flow-DPPO"
    names["dpo"] = "Diffusion-DPO"
    assert set(names) == set(ALGORITHMS)
    for text in (description, intro):
        assert "image" in text and "video" in text, text
        assert all(n in text for n in names.values()), text
