"""Studies: a paper's claim as a family of training runs (claims.py), trained by runner.py, reported by report.py."""
from .claims import STUDIES, Arm, Study
from .runner import run_study

__all__ = ["STUDIES", "Arm", "Study", "run_study"]
