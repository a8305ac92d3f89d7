"""The partition plan, pure arithmetic of the manifest and the layout (no I/O, no RNG state): the slots and their
persons (:mod:`.slots`), windows and order (:mod:`.order`), the frozen :class:`~.partition.Partition`
(:mod:`.partition`), exact validation (:mod:`.exact`), the rest of an epoch after a resume (:mod:`.resume`), and the
plan as ``shardify plan`` prints it (:mod:`.report`)."""
