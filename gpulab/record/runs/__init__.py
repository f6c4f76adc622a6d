"""The lessons' measuring cores: each runs one lesson's experiment on an engine and returns
plain data (the course adds formulas and views; ``gpulab record`` stores the data).

``tensor`` and ``rounding`` (lesson 01), ``params`` (02), ``activations`` (03), ``optimizer``
(05), ``inplace`` and ``inference`` (06), ``checkpoint`` (07), ``precision`` (08).
"""
__all__: list[str] = []
