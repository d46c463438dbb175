"""Distributed: FSDP2 state edits (``fsdp_state``), DTensor collectives on fp8 tensors (``collectives``) and the
fp8 sequence-parallel all-gather (``parallel``). Imports the layers below.
"""
