"""The lab's offline side: the cluster simulator (`simulator`), the jobs it runs (`scenarios`, with the
calibrated `profiles/`), calibration from real run logs (`calibrate`), pretraining and evaluation of
the shipped policy (`pretrain`, `evaluate`) and the policy tools (`policy_tools`).

Pure PyTorch and numpy: never imports Horovod, mpi4py or `comm`. Builds on the library's `control`
(the same decision core and PPO learner as the live controller), `stats` and `optim.lr_scaling`.
"""
