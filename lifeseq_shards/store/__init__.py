"""The on-disk format: the field schema and block codec (:mod:`.format`), a shard's tar members (:mod:`.shardfile`),
the typed manifest (:mod:`.manifest`), a split's lengths index (:mod:`.lengths`), opening a dataset's files wherever
they are (:mod:`.remote`), and writes whose failure is one line naming the path (:mod:`.writes`)."""
