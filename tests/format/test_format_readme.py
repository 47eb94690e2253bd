"""The README's "Wire format" section is the spec: it must be docs/wire-format.md verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_contains_the_wire_format_spec_verbatim():
    spec = (ROOT / "docs" / "wire-format.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert spec.strip() in readme, "README's wire-format section drifted from docs/wire-format.md"
