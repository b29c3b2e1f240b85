"""How the data commands (`rmsft data coco`, `rmsft data check`) say counts and lists in their summaries."""

from __future__ import annotations

LISTED = 10  # names, paths or problems quoted in a summary line before "... and N more"


def counted(count: int, one: str, many: str | None = None) -> str:
    """`3 records`, `1 record`, `2 boxes` (`many` where the plural is not `one` + s)."""
    return f"{count} {one if count == 1 else many or one + 's'}"


def listed(items: list[str]) -> str:
    """The first LISTED items, then how many more."""
    more = len(items) - LISTED
    return ", ".join(items[:LISTED]) + (f", ... and {more} more" if more > 0 else "")
