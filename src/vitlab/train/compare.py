"""Moved to ``vitlab.runs.compare``; this alias is kept for one release."""
from ..runs.compare import compare, format_table, read_run

__all__ = ["compare", "format_table", "read_run"]
