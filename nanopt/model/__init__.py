"""The model and the arithmetic about it: the pure transformer (config in, logits or loss out), its loss,
generation, parameter and FLOP counts, and the memory model.

Imports only the contracts (nanopt.config, nanopt.errors); never devices, ranks, data or files.
"""
