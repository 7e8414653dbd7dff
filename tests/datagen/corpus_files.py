"""Small real documents for the data-build tests: a PDF with a text layer, HTML, text."""

from __future__ import annotations

from pathlib import Path


def pdf_bytes(text: str) -> bytes:
    """A one-page PDF whose text layer is `text` (Helvetica), with a correct xref table."""
    safe = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
    stream = f"BT /F1 12 Tf 72 720 Td ({safe}) Tj ET".encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length " + str(len(stream)).encode() + b" >>\nstream\n" + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for off in offsets:
        out += f"{off:010d} 00000 n \n".encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


PARIS = (
    "The Seine flows through Paris for thirteen kilometres. The city counts thirty-seven "
    "bridges across the river, the oldest standing one being the Pont Neuf, finished in 1607."
)
GLACIER = (
    "Glaciers form where snow accumulates faster than it melts. Over decades the snow "
    "compacts into firn and then into dense glacial ice that flows under its own weight."
)
BEES = (
    "Honey bees communicate the direction of food with the waggle dance. The angle of the "
    "dance relative to vertical encodes the angle between the food and the sun."
)


def make_corpus(root: Path) -> Path:
    """A folder with one document of each kind the ingest stage must handle."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "paris.txt").write_text(PARIS + "\n")
    (root / "notes").mkdir()
    (root / "notes" / "glacier.md").write_text("# Glaciers\n\n" + GLACIER + "\n")
    (root / "bees.html").write_text(
        "<html><head><title>t</title><script>var x = 'SCRIPT TEXT';</script></head>"
        f"<body><nav>menu</nav><p>{BEES}</p></body></html>"
    )
    (root / "report.pdf").write_bytes(pdf_bytes("Copper conducts electricity better than iron does."))
    (root / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00IHDR")
    (root / "empty.txt").write_text("   \n\n")
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (root / "paris_copy.txt").write_text(PARIS + "\n")
    (root / "passwd").symlink_to("/etc/passwd")
    (root / "alias.txt").symlink_to("notes/glacier.md")  # inside: read (a duplicate of it)
    (root / "mojibake.txt").write_text("The caf\u00c3\u00a9 opened in 1907 beside the station.\n")
    return root
