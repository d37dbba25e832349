"""The on-disk format, torch-free where it can be: the manifest and its rules, the shard files
(HDF5, one per rank or per node), records, blocks, checksums and codecs, the directory ROOT and
the commit that makes a checkpoint exist in it, the state tree, ROLLBACK.json."""
