"""Structured outputs (guided decoding): what a request asks for (spec.py, no torch), the
grammar each request carries in the engine core (grammar.py, xgrammar) and the batch's token
masks applied to the logits before sampling (logits.py)."""
