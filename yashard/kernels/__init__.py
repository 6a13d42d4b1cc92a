"""Device kernels (Triton). Imported lazily: yashard works without triton (torch fallbacks)."""
