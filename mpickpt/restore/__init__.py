"""The restore path: the newest checkpoint every rank can load, read into the state in place,
on any number of ranks (resharding), with what a shard that fails verification really is."""
