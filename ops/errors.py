"""The one error type ops raise: a shape or hyper-parameter that cannot work.

The graph catches it and prefixes the layer name, so a user sees which layer is wrong.
"""


class ShapeError(ValueError):
    pass
