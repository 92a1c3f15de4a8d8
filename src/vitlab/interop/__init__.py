"""Converters from other libraries' checkpoint folders: key maps and config translation only."""
