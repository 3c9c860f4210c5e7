"""A rank's drives as one set: ``DriveSet`` opens the rank store on each configured root
(``opening``), keeps each open drive's store, guard, read pool and write ledger
(``driveset``), routes chunks over the drives (``placement``) and shares open stores with a
same-process scheduler (``rankstores``); one root is a set of one, its rules the set's
``DrivePolicy`` (``policy``)."""
