"""Adapters that put m2ops inside other libraries' models (imported on demand: each needs its library)."""
