"""The save path: the snapshot off the training thread, then, on a background thread, the
same sequence into whichever store (ROOT, or the node-local level) a save is for."""
