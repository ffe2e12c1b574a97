"""Helpers that more than one op family uses. Nothing here imports an op family."""
