"""What tests, demos and benchmarks build models from: tiny random configs per tested family and the benchmarks'
model configs (`models.py`). Apart from the engine: the trainer (its built-in tiny model), the tools and the command
line use it; nothing below them imports it.
"""
