"""Turning retrieved passages into text: context formatting, marginalization, decoding."""
