"""The device side of a step: the host and model batch types (:mod:`.batch`), host batch -> device -> model batch
(:mod:`.build`), packed / padded index arithmetic (:mod:`.index`), the next batch built ahead on a side stream
(:mod:`.prefetch`) and the model batch's layout and shape as values (:mod:`.shape`)."""
