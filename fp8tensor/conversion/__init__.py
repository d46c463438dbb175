"""Converting models: the plain fp8 checkpoint layout (``checkpoint``), the torch.export refusal for tensor-parallel
models (``export``), the converted module classes (``modules``) and ``convert_to_fp8`` / ``quantize_weights``
(``convert``). Imports the layers below.
"""
