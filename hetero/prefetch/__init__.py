"""Layer-wise KV prefetch CPU->GPU for prefills that continue a context (not built yet)."""
