"""The one error type every input reader raises: a one-line message naming the file (and row)."""


class SourceError(ValueError):
    """Bad input: the message is one line naming the file (and the row); ``shardify`` exits 2 on it."""
