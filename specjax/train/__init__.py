"""Corpora, hidden-state collection, head training and validation."""
