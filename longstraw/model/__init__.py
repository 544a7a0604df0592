"""What longstraw knows about a model: which models it serves (`capability.py`), how a model is prepared once
(`prepare.py`), what each layer's attention is observed to do (`observe.py`), the capture chunk it gets
(`chunking.py`), what prompt length its positions cover (`positions.py`), and the plain references its optimized
paths are held equal to (`oracles.py`).

Below the prompt state and above the layer kinds, the family specs and the bridge to transformers; nothing here is
imported on package import (`longstraw.prepare`, `longstraw.tested_families` are the public names).
"""
