"""The errors iscore raises.

Every failure a user can cause (a bad dump, a bad config) raises a subclass of
`IscoreError` whose message names the file, column, row or key, what was expected
and what was found. Only the CLI and the app format these for people; the library
never prints.
"""

from collections.abc import Sequence
from dataclasses import dataclass


class IscoreError(Exception):
    """Base class of every error iscore raises on purpose."""


class DumpError(IscoreError):
    """A dump cannot be read: missing, not Parquet, wrong columns, invalid values."""


class ConfigError(IscoreError):
    """A configuration value is missing, of the wrong type or out of range."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a dump.

    Attributes:
        file: the file it is in.
        column: the canonical column it concerns (with its source name), if any.
        message: what is wrong and what was expected.
        rows: the first offending rows, 0-based row numbers within the file.
        count: how many rows (or tokens, where the message says so) are affected.
    """

    file: str
    column: str | None
    message: str
    rows: tuple[int, ...] = ()
    count: int = 0

    def __str__(self) -> str:
        where = self.file if self.column is None else f"{self.file}, column {self.column}"
        # One line, whatever the message quotes (Arrow's and thrift's errors span several).
        message = "; ".join(line.strip() for line in self.message.splitlines() if line.strip())
        text = f"{where}: {message}"
        if self.rows:
            shown = ", ".join(str(r) for r in self.rows)
            more = (
                f" (first {len(self.rows)} of {self.count:,})"
                if self.count > len(self.rows)
                else ""
            )
            text += f" at row{'s' if len(self.rows) > 1 else ''} {shown}{more}"
        return text


class DumpProblems(DumpError):
    """A dump has problems; `problems` lists every one found."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[type, tuple[tuple[Problem, ...]]]:
        # Made again from its problems (not its message) where a worker process raised it.
        return type(self), (self.problems,)


QUOTE_LIMIT = 200
"""The most characters of a user's value an error message quotes."""


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` and its noun, singular for 1, e.g. "1 value", "2,048 values".

    >>> counted(1, "value"), counted(2048, "value"), counted(3, "NaN value", "NaN values")
    ('1 value', '2,048 values', '3 NaN values')
    """
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)` cut to `limit` characters, for error messages.

    A message quotes what the user gave so they can find it, but a value can be a whole
    pasted config or a megabyte string: printing it back would flood a terminal or a page.

    >>> quote("x" * 500)[:12], len(quote("x" * 500))
    ("'xxxxxxxxxxx", 220)
    >>> quote(2.5)
    '2.5'
    """
    return clip(repr(value), limit)


def clip(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` cut to `limit` characters, saying how long it was, with control characters
    escaped (for names and keys shown in a terminal or a message).

    >>> clip("abc"), clip("k" * 300, 4)
    ('abc', 'kkkk... (300 characters)')
    >>> print(clip("a\\x1b[2Jb"))
    a\\x1b[2Jb
    """
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"
