"""Reversible, dtype-aware rearrangements applied before a codec sees the bytes."""
