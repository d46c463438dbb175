"""The foundation: every private PyTorch API and tracing-state question (``compat``), the CUDA-graph capture in
progress (``capture``) and the library's settings (``settings``). Imports nothing of fp8tensor.
"""
