"""Shared plumbing below every stage: errors, argument validation, atomic I/O, checksums, devices."""
