"""The epoch plan: one interface (:mod:`.epoch`'s ``EpochPlan``) that the reader, the loader's resume and
``shardify plan`` ask, whichever plan forms the batches (batches of persons, or of a token budget), and what it is
asked (:mod:`.asked`).
The partition plan, pure arithmetic of the manifest and the arrangement (no I/O, no RNG state): the slots and their
persons (:mod:`.slots`), windows and order (:mod:`.order`), the frozen :class:`~.partition.Partition`
(:mod:`.partition`), exact validation (:mod:`.exact`), the rest of an epoch after a resume (:mod:`.resume`), and the
plan as ``shardify plan`` prints it (:mod:`.report`). The token-budget plan: each step's persons per rank
(:mod:`.balance`), the steps of an epoch and the budgets it accepts (:mod:`.budget`), the epoch's stream and its
slot edges (:mod:`.stream`), the epoch as the reader runs it (:mod:`.tokens`), and the persons plan seen as a budget
plan, to compare the two (:mod:`.compare`)."""
