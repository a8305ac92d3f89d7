"""Embeddings of everyone after pre-training: the prediction writer (:mod:`.writer`), the output directory of one
Parquet file per input shard (:mod:`.store`), and its checks and merge (:mod:`.check`)."""
