"""Model code that knows nothing of cells, MPI or trees: the tiny causal LM and its checkpoints."""
