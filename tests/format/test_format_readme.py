"""The wire format is specified in one place, docs/wire-format.md (whose example blob the
golden-bytes tests pin); the README links to it and carries no copy that could drift."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "wire-format.md"


def test_the_readme_links_the_wire_format_spec() -> None:
    assert "(docs/wire-format.md)" in (ROOT / "README.md").read_text()


def test_no_other_page_copies_the_wire_format_byte_tables() -> None:
    # the fixed header's magic row and the golden example's header line are in the spec only
    markers = ('`44 53 59 42` (`"DSYB"`)', "header   44535942 0200")
    spec = SPEC.read_text()
    assert all(m in spec for m in markers)
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    copies = [
        p.name
        for p in pages
        if p != SPEC and p.exists() and any(m in p.read_text() for m in markers)
    ]
    assert not copies, f"wire-format tables copied outside docs/wire-format.md: {copies}"
