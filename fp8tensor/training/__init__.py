"""Training: recipes and the size rule (``recipes``), the fp8 Linear (``linear``), fp8 grouped GEMMs of experts
(``grouped``), the high-precision master weight (``master``) and the whole-step CUDA graph (``graphs``). Imports
the layers below.
"""
