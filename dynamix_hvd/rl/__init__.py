"""Learning offline: the PPO learner (`ppo`), the cluster simulator (`simulator`), its calibration
from real run logs (`calibrate`) and pretraining of the shipped policy (`pretrain`).

Pure PyTorch and numpy: never imports Horovod, mpi4py or `comm`. May import `control` (to make the
same decisions as the live controller) and `stats`.
"""
