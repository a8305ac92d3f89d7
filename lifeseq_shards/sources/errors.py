"""The one error type every input reader raises: a one-line message naming the file (and row)."""


class SourceError(ValueError):
    pass
