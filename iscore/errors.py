"""The errors iscore raises.

Every failure a user can cause (a bad dump, a bad config) raises a subclass of
`IscoreError` whose message names the file, column, row or key, what was expected
and what was found. Only the CLI and the app format these for people; the library
never prints.
"""


class IscoreError(Exception):
    """Base class of every error iscore raises on purpose."""


class DumpError(IscoreError):
    """A dump cannot be read: missing, not Parquet, wrong columns, invalid values."""


class ConfigError(IscoreError):
    """A configuration value is missing, of the wrong type or out of range."""
