"""Moved to ``vitlab.studies``; this alias is kept for one release."""
from ..studies import STUDIES, Arm, Study, run_study

__all__ = ["STUDIES", "Arm", "Study", "run_study"]
