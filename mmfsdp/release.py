"""The mmfsdp release (also in setup.py), for the package and the ranks' fingerprint."""

__version__ = '0.1.0'
