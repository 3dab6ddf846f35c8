"""The one cluster model: the snapshot (nodes, GPUs and their free shares, the jobs bound to
them), what a job asks, node pools and their node templates, and the scheduling predicates."""
