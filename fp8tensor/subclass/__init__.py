"""The tensor and its op table: ``ScaledFp8Tensor`` (``tensor``), its non-GEMM ops (``ops``) and the GEMM engine
(``gemm``). Imports ``core`` and ``numerics``.
"""
