"""Shipped files name no made-up location: links into the docs are relative, the sidecar image
is the Dockerfile's (its registry set once, in kustomization.yaml), and the one placeholder
left is the inference engine's image, marked PLACEHOLDER."""

import re

from deploy_files import DEPLOY, ROOT

MADE_UP = re.compile(r"(github\.com|ghcr\.io|gitlab\.com|quay\.io|docker\.io)/example\b|example\.org")
SHIPPED = [
    *DEPLOY.rglob("*"),
    *(ROOT / "configs").rglob("*.toml"),
    ROOT / "Dockerfile",
    ROOT / "README.md",
    *(ROOT / "docs").glob("*.md"),
]


def test_no_shipped_file_points_at_a_made_up_location():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SHIPPED
        if path.is_file()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if MADE_UP.search(line)
    ]
    assert found == []


def test_the_only_placeholder_image_is_the_engines():
    images = [
        (path.name, line.split("image:", 1)[1].split("#")[0].strip())
        for path in DEPLOY.rglob("*.yaml")
        for line in path.read_text().splitlines()
        if line.strip().startswith("image:")
    ]
    assert images
    for name, image in images:
        assert "PLACEHOLDER" in image or image.startswith("pd-transfer:"), (name, image)
        assert "example" not in image or "PLACEHOLDER" in image, (name, image)
