"""Tree sizing: how many draft nodes each step of a request asks for (`speculation.tree_size`),
and the record of what came of it.

`request.py` holds the state, router-wide per arm and per request, and asks the arm's strategy
(`strategies.py`; ProPD's in `adaptive.py`) with the values it chooses from (`choice.py`); the
strategies price trees with `cost.py` (step times) and `acceptance.py` (expected tokens per
size), or follow Minions' speculation length (`length.py`).
"""
from specmesh_services.router.sizing.choice import StepChoice
from specmesh_services.router.sizing.cost import PassTimes, VerifyStep, bucket_of
from specmesh_services.router.sizing.request import BatchShare, RequestSizing, TreeSizing

__all__ = ["BatchShare", "PassTimes", "RequestSizing", "StepChoice", "TreeSizing", "VerifyStep",
           "bucket_of"]
