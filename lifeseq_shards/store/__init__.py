"""The on-disk format: the field schema and block codec (:mod:`.format`), a shard's tar members (:mod:`.shardfile`),
the typed manifest (:mod:`.manifest`), and opening a dataset's files wherever they are (:mod:`.remote`)."""
