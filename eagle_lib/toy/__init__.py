"""Toy world."""
