"""The command line (``python3 -m dilated_attention``): ``check`` against the float64
reference, ``bench`` and ``decode-bench``, ``pattern`` pictures, and the ``train`` and
``generate`` commands of :mod:`dilated_attention.training`."""
