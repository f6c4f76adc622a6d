"""What the ``gpulab`` command (``gpulab.cli``) needs besides its parser: the values checked
together before torch loads (``checks``) and the answers as text (``answers``)."""

__all__: list[str] = []
