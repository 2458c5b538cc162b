"""Embedding a corpus larger than one machine with Ray Data: each actor runs the engine a
TorchServe worker runs, assembled in-process from a built archive (the `ray` extra).

- archive.py: the archive's model files, unpacked once per node, and the settings it was built with;
- embedder.py: `ArchiveEmbedder`, the callable class for `Dataset.map_batches`;
- job.py: `python -m embedserve.ray_data`, Parquet in, Parquet out (docs/bulk.md)."""
