"""The lab: benchmarks and everything offline that builds on the library (run from the repository root).

* ``bench.lab``: cluster simulator, scenarios and calibrated profiles, calibration, pretraining and
  evaluation of the shipped policy, policy tools (``python -m bench.lab.policy_tools --help``);
* ``bench.jobs``: the benchmark's training jobs (MLP, CNN, char-LM) and their shared flags and records;
* ``bench.suite``, ``bench.zoo``, ``bench.bench_NAME``, ``bench.chaos``, ``bench.demo``, the GPU scripts:
  run each as ``python -m bench.NAME``.
"""
