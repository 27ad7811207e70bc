"""Integer helpers shared by the planner and the kernels."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= a``."""
    return ceil_div(a, multiple) * multiple
