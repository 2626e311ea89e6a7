"""Model code that knows nothing of cells, MPI or trees: the decoder, its tokenizers and HF checkpoint folders."""
