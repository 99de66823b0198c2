"""Plain-text tables for terminal reports."""

from typing import Any


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(headers, widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows
    ]
    return "\n".join(lines)


def format_markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
