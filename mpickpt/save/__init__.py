"""The save path: the snapshot off the training thread (capture, snapshot, the pinned pool),
then, on a background thread, the same sequence into whichever store the save is for (ROOT, or
the node-local level first), and what follows a commit (upkeep, retention)."""
