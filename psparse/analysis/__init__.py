"""Reading finished runs: ``psparse-report`` (``report.py``), ``psparse-model`` (``costmodel.py``,
the predicted time per iteration) and ``psparse-locality`` (``locality.py``).
"""
