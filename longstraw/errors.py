"""The exceptions longstraw raises to say a model or an input is outside what it serves."""


class UnsupportedArchitectureError(ValueError):
    """The model has a layer or an attention variant longstraw cannot represent, or failed the self-check."""
