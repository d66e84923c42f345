"""The optional zoo tier: ``pytest -m zoo tests/zoo`` (docs/contributing.md, the test tiers)."""
import sys
from pathlib import Path

# harness.py and the shared job runner, for a run that does not read pyproject.toml.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'support'))
