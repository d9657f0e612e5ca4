"""Run outputs: the run-log format and its writer (`runlog`: epochs.csv, trace.h5, meta.json) and
the PNG report drawn from a finished run (`report`). May import `data` and `tools.progress`.
"""
