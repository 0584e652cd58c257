"""Every YAML and JSON file under deploy/ parses (yaml.safe_load_all, json.loads)."""

import json

import pytest
import yaml
from deploy_files import DEPLOY

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted(DEPLOY.rglob("*.json"))


def test_deploy_has_yaml_and_json_files():
    assert len(YAML_FILES) >= 7 and JSON_FILES


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_file_parses_into_mappings(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no document"
    assert all(isinstance(doc, dict) for doc in docs), f"{path}: a document is not a mapping"


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_file_parses(path):
    assert isinstance(json.loads(path.read_text()), dict)
