"""Run outputs: the run-log writer (`runlog`: epochs.csv, trace.h5, meta.json, gathered through
`comm`'s named collectives), the reader of a finished run directory (`rundir`), the straggler diagnosis
(`diagnosis`: pure numpy/pandas, no MPI, Horovod or `comm`), the PNG report drawn from it (`report`),
optional TensorBoard event files (`tensorboard`) and what a user sees while a job runs (`progress`).
May import `data`, `comm` and `logs`.
"""
