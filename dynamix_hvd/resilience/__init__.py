"""Surviving faults: preemption checkpoints with exact resume (`checkpoint`) and Horovod elastic
state handlers (`elastic`). May import `data`, `control` and `comm`; Horovod only in `elastic`.
"""
