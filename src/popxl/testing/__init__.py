"""Helpers for tests of popxl programs (PopXL's ``popxl.testing``)."""
from ._dtypes import get_all_dtypes, get_all_int_dtypes  # noqa: F401

__all__ = ["get_all_dtypes", "get_all_int_dtypes"]
