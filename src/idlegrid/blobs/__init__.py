"""Blobs: content-addressed files (files.py) and who may read or write each (access.py)."""
