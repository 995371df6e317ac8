"""V-JEPA 3D pretraining and frozen-encoder probes for OCT volumes."""
