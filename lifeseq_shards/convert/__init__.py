"""``shardify convert`` and the dataset checks: the researchers' files in (:mod:`.sources`), two passes
(:mod:`.passes`, the first's encoding and spilling in :mod:`.encode`, where each person goes in :mod:`.share`)
through the writers (:mod:`.writers`) into an output directory replaced only when complete (:mod:`.outdir`); the same
conversion as the tasks of a job array and their merge (:mod:`.array`); ``verify``, ``upgrade`` and ``inspect``
(:mod:`.integrity`)."""
