"""Item encoding: tensor bytes -> transform -> codec chunks -> container record, and back."""
