"""Trajectory trees: build, admit, pack, train with tree masking, store in Zarr."""
