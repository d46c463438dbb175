"""fp8 numerics: the Triton kernels (``kernels``), ``quantize`` — the one door to them and the home of every custom
op — and the FSDP2 all-gather payload of plain fp8 data and scales (``fsdp_payload``). Imports ``core``.
"""
