"""Run folders: the format a training run writes (file names, typed rows and summary), comparing runs, figures."""
from .format import (
    CONFIG_YAML,
    CONFUSION_PNG,
    CURVES_PNG,
    METRICS,
    SUMMARY,
    EpochRow,
    EvalSummary,
    Summary,
    check_out_dir,
    has_config,
    is_finished,
    read_config,
    read_history,
    read_summary,
    write_config,
    write_metrics,
    write_summary,
)

__all__ = ["CONFIG_YAML", "CONFUSION_PNG", "CURVES_PNG", "METRICS", "SUMMARY", "EpochRow", "EvalSummary", "Summary",
           "check_out_dir", "has_config", "is_finished", "read_config", "read_history", "read_summary",
           "write_config", "write_metrics", "write_summary"]
