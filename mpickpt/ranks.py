"""Rank lists as people read them: ``[1, 3, 4, 5]`` -> ``"ranks 1,3-5"``. Torch- and MPI-free,
shared by the protocol's reports and the operator's tools."""

from __future__ import annotations

from collections.abc import Iterable

MAX_RANGES = 32  # a rank list longer than this many ranges is cut short in messages


def spans(ranks: Iterable[int]) -> list[list[int]]:
    """Sorted runs of consecutive ranks as [first, last] pairs."""
    out: list[list[int]] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def unspan(runs: list[list[int]]) -> list[int]:
    """The ranks of :func:`spans`' runs."""
    return [r for a, b in runs for r in range(int(a), int(b) + 1)]


def rank_ranges(ranks: Iterable[int], limit: int = MAX_RANGES) -> str:
    """Ranks as sorted ranges: ``[1, 3, 4, 5] -> "1,3-5"``; past ``limit`` ranges the rest is
    counted instead of listed ("0,2,4,... and 10 more ranks")."""
    runs = spans(ranks)
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    if len(runs) > limit:
        rest = sum(b - a + 1 for a, b in runs[limit:])
        text += f",... and {rest} more rank{'s' if rest != 1 else ''}"
    return text


def ranks_text(ranks: Iterable[int]) -> str:
    """``"rank 2"``, ``"ranks 1,3-5"``."""
    ranks = sorted(set(ranks))
    return f"rank{'s' if len(ranks) != 1 else ''} {rank_ranges(ranks)}"


def by_reason(reasons: list[tuple[int, str]]) -> list[str]:
    """``(rank, reason)`` pairs as texts, in rank order: a reason that more than two ranks
    gave alike (but for the ``rank N: `` it starts with) once, after their ranks."""
    by: dict[str, list[int]] = {}
    for rank, text in reasons:
        own = f"rank {rank}: "
        by.setdefault(text[len(own):] if text.startswith(own) else text, []).append(rank)
    out: list[tuple[int, str]] = []
    for rank, text in reasons:
        own = f"rank {rank}: "
        rest = text[len(own):] if text.startswith(own) else text
        ranks = by[rest]
        if len(ranks) <= 2:
            out.append((rank, text))
        elif ranks[0] == rank:
            out.append((rank, f"{ranks_text(ranks)}: {rest}"))
    return [t for _, t in sorted(out, key=lambda p: p[0])]
