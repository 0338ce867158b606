"""Metrics and evaluation drivers."""
