"""The model: its shape (shape.py), the transformer and its MoE layers, the device mesh and shardings, and
what it counts (parameters, FLOPs). Imports nothing else of the trainer."""
