"""The Zarr volume cache: build, store, stage, and (for training) read."""
