"""Embeddings of everyone after pre-training: the prediction writer (:mod:`.writer`), the output directory of one
Parquet file per input shard (:mod:`.store`) and what it holds (:mod:`.spec`), each file's provenance stamp
(:mod:`.stamp`), and the directory's checks and merge (:mod:`.check`)."""
